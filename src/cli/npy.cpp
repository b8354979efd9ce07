#include "cli/npy.hpp"

#include <bit>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>

#include <unistd.h>

#include "magi/error.hpp"

namespace magi::cli {
namespace {

static_assert(std::endian::native == std::endian::little, "the .npy reader assumes a little-endian host");

constexpr unsigned char kMagic[] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr size_t kHeaderAlignment = 64;  // numpy aligns the data start to 64 bytes

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw InvalidArgument(path + ": " + problem);
}

// The header is a Python dict literal such as {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }.
// Values we need are strings, booleans and tuples of integers; anything else is rejected.
struct HeaderParser {
  std::string_view text;
  const std::string& path;
  size_t pos = 0;

  void skip_space() {
    while (pos < text.size() && std::isspace(static_cast<unsigned char>(text[pos]))) ++pos;
  }
  [[noreturn]] void bad(const std::string& what) {
    fail(path, "malformed .npy header (" + what + "): " + std::string(text.substr(0, text.find_last_not_of(" \n") + 1)));
  }
  bool accept(char c) {
    skip_space();
    if (pos < text.size() && text[pos] == c) {
      ++pos;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!accept(c)) bad(std::string("expected '") + c + "'");
  }
  std::string string_literal() {
    skip_space();
    if (pos >= text.size() || (text[pos] != '\'' && text[pos] != '"')) bad("expected a string");
    const char quote = text[pos++];
    const size_t end = text.find(quote, pos);
    if (end == std::string_view::npos) bad("unterminated string");
    std::string value(text.substr(pos, end - pos));
    pos = end + 1;
    return value;
  }
  bool boolean() {
    skip_space();
    for (auto [word, value] : {std::pair{"True", true}, std::pair{"False", false}}) {
      const size_t n = std::strlen(word);
      if (text.substr(pos, n) == word) {
        pos += n;
        return value;
      }
    }
    bad("expected True or False");
  }
  std::vector<int64_t> shape_tuple() {
    expect('(');
    std::vector<int64_t> dims;
    while (!accept(')')) {
      skip_space();
      int64_t value = 0;
      size_t digits = 0;
      while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
        if (value > (int64_t{1} << 50)) bad("dimension too large");
        value = value * 10 + (text[pos++] - '0');
        ++digits;
      }
      if (digits == 0) bad("expected a non-negative integer in shape");
      dims.push_back(value);
      if (!accept(',')) {
        expect(')');
        break;
      }
    }
    return dims;
  }
};

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

Header parse_header(std::string_view text, const std::string& path) {
  HeaderParser p{text, path};
  Header header;
  bool have_descr = false, have_order = false, have_shape = false;
  p.expect('{');
  while (!p.accept('}')) {
    const std::string key = p.string_literal();
    p.expect(':');
    if (key == "descr") {
      header.descr = p.string_literal();
      have_descr = true;
    } else if (key == "fortran_order") {
      header.fortran_order = p.boolean();
      have_order = true;
    } else if (key == "shape") {
      header.shape = p.shape_tuple();
      have_shape = true;
    } else {
      p.bad("unexpected key '" + key + "'");
    }
    if (!p.accept(',')) {
      p.expect('}');
      break;
    }
  }
  if (!have_descr || !have_order || !have_shape) p.bad("needs the keys descr, fortran_order and shape");
  // numpy pads the dict with spaces and a newline; anything else after it is not a .npy header.
  p.skip_space();
  if (p.pos != text.size()) p.bad("unexpected text after the dict");
  return header;
}

std::string shape_tuple_text(std::span<const int64_t> shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) text += std::to_string(shape[i]) + (i + 1 < shape.size() ? ", " : "");
  return text + (shape.size() == 1 ? ",)" : ")");
}

std::vector<unsigned char> encode(std::string_view descr, std::span<const int64_t> shape, const void* data,
                                  size_t nbytes) {
  std::string header = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': " +
                       shape_tuple_text(shape) + ", }";
  // Version 1.0 while the header fits a 16-bit length, else 2.0 (32-bit length).
  size_t prefix = sizeof(kMagic) + 2 + 2;
  if (header.size() + 1 + prefix + kHeaderAlignment > 65535) prefix += 2;
  const size_t padded = (prefix + header.size() + 1 + kHeaderAlignment - 1) / kHeaderAlignment * kHeaderAlignment;
  header.append(padded - prefix - header.size() - 1, ' ');
  header.push_back('\n');

  std::vector<unsigned char> bytes(kMagic, kMagic + sizeof(kMagic));
  const bool v2 = prefix == sizeof(kMagic) + 6;
  bytes.push_back(v2 ? 2 : 1);
  bytes.push_back(0);
  const uint32_t length = static_cast<uint32_t>(header.size());
  for (size_t i = 0; i < (v2 ? 4u : 2u); ++i) bytes.push_back(static_cast<unsigned char>(length >> (8 * i)));
  bytes.insert(bytes.end(), header.begin(), header.end());
  const auto* raw = static_cast<const unsigned char*>(data);
  bytes.insert(bytes.end(), raw, raw + nbytes);
  return bytes;
}

int64_t product(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The element count of a header's shape, or nothing when it overflows int64 (each extent alone may be 2^50).
std::optional<int64_t> checked_product(std::span<const int64_t> shape) {
  for (int64_t d : shape)
    if (d == 0) return 0;
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  return n;
}

// Where the data of a file starting with `prefix` begins, or nothing where the prefix is not a supported .npy start
// (parse_npy says why).
std::optional<size_t> data_start_of(std::span<const unsigned char> prefix) {
  if (prefix.size() < sizeof(kMagic) + 4 || std::memcmp(prefix.data(), kMagic, sizeof(kMagic)) != 0) return std::nullopt;
  const int major = prefix[6], minor = prefix[7];
  if ((major != 1 && major != 2) || minor != 0) return std::nullopt;
  const size_t length_bytes = major == 1 ? 2 : 4;
  if (prefix.size() < 8 + length_bytes) return std::nullopt;
  size_t header_length = 0;
  for (size_t i = 0; i < length_bytes; ++i) header_length |= size_t{prefix[8 + i]} << (8 * i);
  return 8 + length_bytes + header_length;
}

// The file size that a complete header announces (header and data), or nothing where the header names no supported
// dtype or a size beyond 64 bits (parse_npy says why). A malformed header throws parse_npy's error.
std::optional<size_t> announced_size(std::span<const unsigned char> prefix, size_t data_start, const std::string& path) {
  if (prefix.size() < data_start) return std::nullopt;
  const size_t header_offset = prefix[6] == 1 ? 10 : 12;
  const Header header = parse_header(
      std::string_view(reinterpret_cast<const char*>(prefix.data()) + header_offset, data_start - header_offset), path);
  const int64_t item = header.descr == "<f4" ? 4 : header.descr == "<f8" ? 8 : 0;
  const std::optional<int64_t> count = checked_product(header.shape);
  int64_t data_bytes = 0;
  size_t total = 0;
  if (item == 0 || !count || __builtin_mul_overflow(*count, item, &data_bytes) ||
      __builtin_add_overflow(data_start, static_cast<size_t>(data_bytes), &total))
    return std::nullopt;
  return total;
}

}  // namespace

int64_t NpyArray::numel() const { return product(shape); }

std::string NpyArray::shape_string() const {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += std::to_string(shape[i]) + (i + 1 < shape.size() ? ", " : "");
  return text + "]";
}

NpyArray parse_npy(std::span<const unsigned char> bytes, const std::string& path) {
  if (bytes.size() < sizeof(kMagic) + 4 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    fail(path, "not a .npy file (bad magic; expected \\x93NUMPY)");
  const int major = bytes[6], minor = bytes[7];
  if ((major != 1 && major != 2) || minor != 0)
    fail(path, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor) +
                   " (supported: 1.0, 2.0)");
  const size_t length_bytes = major == 1 ? 2 : 4;
  size_t header_length = 0;
  if (bytes.size() < 8 + length_bytes) fail(path, "truncated .npy header");
  for (size_t i = 0; i < length_bytes; ++i) header_length |= size_t{bytes[8 + i]} << (8 * i);
  const size_t data_start = 8 + length_bytes + header_length;
  if (bytes.size() < data_start) fail(path, "truncated .npy header");
  const std::string_view header_text(reinterpret_cast<const char*>(bytes.data()) + 8 + length_bytes, header_length);
  const Header header = parse_header(header_text, path);

  NpyArray array;
  if (header.descr.size() >= 2 && header.descr[0] == '>')
    fail(path, "big-endian dtype '" + header.descr + "' is not supported (use little-endian '<f4' or '<f8')");
  if (header.descr == "<f4") array.dtype = DType::F32;
  else if (header.descr == "<f8") array.dtype = DType::F64;
  else fail(path, "unsupported dtype '" + header.descr + "' (supported: '<f4' float32, '<f8' float64)");
  if (header.fortran_order) fail(path, "fortran_order True is not supported (save a C-order array)");
  array.shape = header.shape;

  const size_t item = array.dtype == DType::F32 ? 4 : 8;
  const size_t available = bytes.size() - data_start;
  const std::optional<int64_t> count = checked_product(array.shape);
  int64_t expected_bytes = 0;
  if (!count || __builtin_mul_overflow(*count, static_cast<int64_t>(item), &expected_bytes))
    fail(path, "shape " + array.shape_string() + " has more elements than fit in 64 bits (the file has " +
                   std::to_string(available) + " data bytes)");
  const int64_t numel = *count;
  const size_t expected = static_cast<size_t>(expected_bytes);
  if (available < expected)
    fail(path, "truncated data: shape " + array.shape_string() + " needs " + std::to_string(expected) +
                   " bytes, the file has " + std::to_string(available));
  if (available > expected)
    fail(path, "has " + std::to_string(available - expected) + " bytes after the data of shape " +
                   array.shape_string());

  array.values.resize(static_cast<size_t>(numel));
  const unsigned char* data = bytes.data() + data_start;
  for (int64_t i = 0; i < numel; ++i) {
    if (array.dtype == DType::F32) {
      float f;
      std::memcpy(&f, data + i * 4, 4);
      array.values[i] = f;
    } else {
      std::memcpy(&array.values[i], data + i * 8, 8);
    }
  }
  return array;
}

NpyArray read_npy(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail(path, "is a directory, not a .npy file");
  const bool regular = std::filesystem::is_regular_file(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open: ") + std::strerror(errno));
  // Read no more than the header announces (and one byte to see extra data): a device such as /dev/zero, or an endless
  // pipe, was read until memory ran out. A regular file is read to its end, so that extra data is counted.
  std::vector<unsigned char> bytes;
  const auto read_up_to = [&](size_t size) {
    while (bytes.size() < size && in) {
      const size_t old = bytes.size(), chunk = std::min<size_t>(size - old, size_t{1} << 24);
      bytes.resize(old + chunk);
      in.read(reinterpret_cast<char*>(bytes.data() + old), static_cast<std::streamsize>(chunk));
      bytes.resize(old + static_cast<size_t>(in.gcount()));
    }
  };
  read_up_to(sizeof(kMagic) + 6);
  if (const std::optional<size_t> start = data_start_of(bytes)) {
    read_up_to(*start);
    if (const std::optional<size_t> total = announced_size(bytes, *start, path)) {
      read_up_to(*total + 1);
      if (bytes.size() > *total && regular) read_up_to(std::numeric_limits<size_t>::max());
    } else if (regular) {
      read_up_to(std::numeric_limits<size_t>::max());  // parse_npy's message counts the data bytes
    }
  }
  if (in.bad()) fail(path, "read error");
  return parse_npy(bytes, path);
}

std::vector<unsigned char> encode_npy(DType dtype, std::span<const int64_t> shape, std::span<const double> values) {
  if (static_cast<int64_t>(values.size()) != product(shape))
    throw InvalidArgument("encode_npy: " + std::to_string(values.size()) + " values do not fill shape " +
                          shape_tuple_text(shape));
  if (dtype == DType::F64) return encode("<f8", shape, values.data(), values.size() * 8);
  if (dtype != DType::F32)
    throw InvalidArgument("encode_npy: dtype " + std::string(to_string(dtype)) + " (allowed: fp32, fp64)");
  std::vector<float> narrowed(values.begin(), values.end());
  return encode("<f4", shape, narrowed.data(), narrowed.size() * 4);
}

std::vector<unsigned char> encode_npy(std::span<const int64_t> shape, std::span<const float> values) {
  if (static_cast<int64_t>(values.size()) != product(shape))
    throw InvalidArgument("encode_npy: " + std::to_string(values.size()) + " values do not fill shape " +
                          shape_tuple_text(shape));
  return encode("<f4", shape, values.data(), values.size() * 4);
}

void write_file(const std::string& path, std::span<const unsigned char> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, std::string("cannot create: ") + std::strerror(errno));
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) fail(path, "write error");
}

std::filesystem::path temporary_beside(const std::filesystem::path& path) {
  return path.parent_path() / ("." + path.filename().string() + ".tmp." + std::to_string(::getpid()));
}

bool same_file(const std::filesystem::path& a, const std::filesystem::path& b) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) {
    const bool same = fs::equivalent(a, b, ec);
    if (!ec) return same;
  }
  const fs::path ca = fs::weakly_canonical(a, ec);
  if (ec) return false;
  const fs::path cb = fs::weakly_canonical(b, ec);
  return !ec && ca == cb;
}

void replace_file(const std::string& path, const std::function<void(const std::string& temporary)>& write) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail(path, "cannot write: is a directory");
  // The rename would replace a device or FIFO (as root, /dev/null itself) with a regular file.
  if (const fs::file_status st = fs::status(path, ec); fs::exists(st) && !fs::is_regular_file(st))
    fail(path, "cannot write: exists and is not a regular file (allowed: a new file or a regular file to replace)");
  const std::string temporary = temporary_beside(path).string();
  try {
    write(temporary);
    fs::rename(temporary, path, ec);
    if (ec) fail(path, "cannot write: " + ec.message());
  } catch (const std::exception& e) {
    fs::remove(temporary, ec);
    // The writer names the temporary; the user knows the target.
    std::string message = e.what();
    for (size_t at = message.find(temporary); at != std::string::npos; at = message.find(temporary, at + path.size()))
      message.replace(at, temporary.size(), path);
    throw InvalidArgument(message);
  }
}

void replace_file(const std::string& path, std::span<const unsigned char> bytes) {
  replace_file(path, [&](const std::string& temporary) { write_file(temporary, bytes); });
}

}  // namespace magi::cli
