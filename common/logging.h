// Minimal leveled logging to stderr: `SPECD_LOG(INFO) << "listening on " << addr;`.
// Abseil 20220623 has no absl/log, and services need little more than timestamped lines that do
// not interleave across threads (each message is written with one fwrite).
#ifndef SPECD_COMMON_LOGGING_H_
#define SPECD_COMMON_LOGGING_H_

#include <sstream>
#include <string>

namespace specd {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Default kInfo; the SPECD_LOG_LEVEL environment
// variable (debug, info, warning, error) overrides it at the first message.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();

namespace logging_internal {

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;

  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Swallows the stream expression when the level is disabled, so its operands are not evaluated.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace logging_internal
}  // namespace specd

#define SPECD_LOG_LEVEL_DEBUG ::specd::LogLevel::kDebug
#define SPECD_LOG_LEVEL_INFO ::specd::LogLevel::kInfo
#define SPECD_LOG_LEVEL_WARNING ::specd::LogLevel::kWarning
#define SPECD_LOG_LEVEL_ERROR ::specd::LogLevel::kError

#define SPECD_LOG(severity)                                                                       \
  (SPECD_LOG_LEVEL_##severity < ::specd::MinLogLevel())                                           \
      ? (void)0                                                                                   \
      : ::specd::logging_internal::Voidify() &                                                    \
            ::specd::logging_internal::LogMessage(SPECD_LOG_LEVEL_##severity, __FILE__, __LINE__) \
                .stream()

#endif  // SPECD_COMMON_LOGGING_H_
