#include "common/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace specd {
namespace {

int LevelFromEnv() {
  const char* env = std::getenv("SPECD_LOG_LEVEL");
  if (env == nullptr) return static_cast<int>(LogLevel::kInfo);
  const std::string v = absl::AsciiStrToLower(env);
  if (v == "debug") return static_cast<int>(LogLevel::kDebug);
  if (v == "warning") return static_cast<int>(LogLevel::kWarning);
  if (v == "error") return static_cast<int>(LogLevel::kError);
  return static_cast<int>(LogLevel::kInfo);
}

std::atomic<int>& MinLevel() {
  static std::atomic<int> level{LevelFromEnv()};
  return level;
}

}  // namespace

void SetMinLogLevel(LogLevel level) { MinLevel().store(static_cast<int>(level)); }

LogLevel MinLogLevel() { return static_cast<LogLevel>(MinLevel().load(std::memory_order_relaxed)); }

namespace logging_internal {

LogMessage::LogMessage(LogLevel level, const char* file, int line) {
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  const char* base = std::strrchr(file, '/');
  stream_ << kLetters[static_cast<int>(level)]
          << absl::FormatTime("%Y-%m-%d %H:%M:%E6S", absl::Now(), absl::LocalTimeZone()) << ' '
          << (base != nullptr ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string text = stream_.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace logging_internal
}  // namespace specd
