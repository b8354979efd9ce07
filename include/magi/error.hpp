// Errors thrown at the API edge. Library code never exits; the CLI turns these into one line + exit 2.
#pragma once

#include <stdexcept>
#include <string>

namespace magi {

// Base of every error the library throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller-supplied value is invalid. The message names the argument and the allowed values.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A feature that exists in the configuration surface but is not available in this build/platform.
class NotAvailable : public Error {
 public:
  using Error::Error;
};

}  // namespace magi
