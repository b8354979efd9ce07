// A small thread-safe least-recently-used cache: the one cache type of the library (plans of every backend,
// distributed runtimes). Keys are compared exactly (operator==), never hashed, so a hit is always the same
// problem. Lookups are linear: caches hold tens to a thousand entries of expensive values.
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <utility>

namespace magi {

template <class Key, class Value>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity) {}

  // The cached value for `key`, else make() (called without the lock held, so it may be slow or throw;
  // nothing is cached then). Returns shared ownership: an evicted value lives on while a caller holds it.
  template <class Make>
  std::shared_ptr<Value> get(const Key& key, Make&& make) {
    {
      std::lock_guard lock(mutex_);
      for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (it->first == key) {
          entries_.splice(entries_.begin(), entries_, it);
          return it->second;
        }
      }
    }
    std::shared_ptr<Value> value = make();
    std::lock_guard lock(mutex_);
    entries_.emplace_front(key, value);
    while (entries_.size() > capacity_) entries_.pop_back();
    return value;
  }

  void set_capacity(size_t capacity) {
    std::lock_guard lock(mutex_);
    capacity_ = capacity;
    while (entries_.size() > capacity_) entries_.pop_back();
  }
  size_t size() const {
    std::lock_guard lock(mutex_);
    return entries_.size();
  }
  template <class Pred>
  void erase_if(Pred&& pred) {
    std::lock_guard lock(mutex_);
    entries_.remove_if([&](const auto& entry) { return pred(entry.first); });
  }
  void clear() {
    std::lock_guard lock(mutex_);
    entries_.clear();
  }

 private:
  size_t capacity_;
  mutable std::mutex mutex_;
  std::list<std::pair<Key, std::shared_ptr<Value>>> entries_;
};

}  // namespace magi
