// An internal failure of a call (gRPC or REST): a request id for the client's message, and the server log's line
// (the first failure of an operation, then its 10th, 100th, ... with the count), as the Python server logs them.
#pragma once

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <string>

namespace embserve::server {

// Log `what` for `operation` (rate-limited per operation) and return the request id the answer names.
inline std::string log_internal(const std::string& operation, const char* what) {
  static std::mutex mutex;
  static std::map<std::string, int64_t> counts;
  static std::mt19937_64 random{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mutex);
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(random()));
  const std::string id(text, 12);
  const int64_t count = ++counts[operation];
  const std::string digits = std::to_string(count);
  if (count == 1)
    std::cerr << "ERROR embserve-server: " << operation << " failed (request id " << id << "): " << what << std::endl;
  else if (digits.find_first_not_of('0', 1) == std::string::npos && digits[0] == '1')
    std::cerr << "ERROR embserve-server: " << operation << " failed again (request id " << id << "): " << count
              << " failures so far" << std::endl;
  return id;
}

}  // namespace embserve::server
