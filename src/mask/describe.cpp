// describe(): the text `magi-attn mask` prints and the Python package's Mask.describe() returns.
#include <cstdint>
#include <cstdio>
#include <iomanip>
#include <sstream>
#include <string>

#include "magi/mask.hpp"
#include "mask/picture.hpp"

namespace magi {
namespace {

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

std::string range_text(const Range& r) {
  std::ostringstream os;
  os << '[' << r.start << ", " << r.end << ')';
  return os.str();
}

}  // namespace

std::string describe(const Mask& mask) {
  validate(mask);
  std::ostringstream os;
  constexpr size_t kHead = 12, kTail = 4;  // long slice lists show their first and last entries
  const int64_t area = mask.area();
  os << "mask: " << mask.slices.size() << " slice" << (mask.slices.size() == 1 ? "" : "s") << ", total_q "
     << mask.total_q << ", total_k " << mask.total_k << " (valid)\n";
  char density[32];
  std::snprintf(density, sizeof density, "%.4g%%", 100.0 * mask.density());
  os << "area: " << with_commas(area) << " of " << with_commas(int64_t{mask.total_q} * mask.total_k)
     << " cells, density " << density << "\n";
  if (!mask.slices.empty()) {
    os << "slices:\n";
    os << "  " << std::setw(6) << "#" << "  " << std::left << std::setw(24) << "q_range" << std::setw(24) << "k_range"
       << std::setw(11) << "type" << std::right << "area\n";
    for (size_t i = 0; i < mask.slices.size(); ++i) {
      if (mask.slices.size() > kHead + kTail && i == kHead) {
        os << "  " << std::setw(6) << "..." << "  (" << mask.slices.size() - kHead - kTail << " more)\n";
        i = mask.slices.size() - kTail;
      }
      const Slice& s = mask.slices[i];
      os << "  " << std::setw(6) << i << "  " << std::left << std::setw(24) << range_text(s.q) << std::setw(24)
         << range_text(s.k) << std::setw(11) << to_string(s.type) << std::right << with_commas(magi::area(s)) << "\n";
    }
  }
  os << "picture " << picture::text_picture(mask);
  return os.str();
}


}  // namespace magi
