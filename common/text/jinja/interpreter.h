// Interpreter of specd's Jinja engine: walks the syntax tree with jinja2's scoping (a `for`
// body is a fresh scope each iteration; `if` shares its scope; macros see their defining scope
// at call time) and Python's operator semantics.
#ifndef SPECD_COMMON_TEXT_JINJA_INTERPRETER_H_
#define SPECD_COMMON_TEXT_JINJA_INTERPRETER_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/text/jinja/ast.h"
#include "common/text/jinja/value.h"

namespace specd::jinja {

// One scope of variables.
class Frame {
 public:
  explicit Frame(std::shared_ptr<Frame> parent) : parent_(std::move(parent)) {}

  const Value* Lookup(const std::string& name) const {
    for (const Frame* f = this; f != nullptr; f = f->parent_.get()) {
      const auto it = f->vars_.find(name);
      if (it != f->vars_.end()) return &it->second;
    }
    return nullptr;
  }
  void Set(const std::string& name, Value value) { vars_[name] = std::move(value); }

 private:
  std::shared_ptr<Frame> parent_;
  absl::flat_hash_map<std::string, Value> vars_;
};

class Interpreter {
 public:
  // `globals` resolve names no scope defines (raise_exception, range, ...).
  explicit Interpreter(const absl::flat_hash_map<std::string, Value>* globals)
      : globals_(globals) {}

  // Renders `nodes` in `frame`. Errors are INVALID_ARGUMENT with jinja2's message; line() says
  // where the first one happened.
  absl::Status Render(const NodeList& nodes, const std::shared_ptr<Frame>& frame, std::string* out);
  int error_line() const { return error_line_; }

  absl::StatusOr<Value> Eval(const Expr& e, const std::shared_ptr<Frame>& frame);
  absl::StatusOr<Value> Call(const Value& callee, CallArgs& args);

  // Python's iter(value) as a list: items, dict keys, characters; Undefined is empty.
  static absl::StatusOr<std::vector<Value>> Iterate(const Value& value);
  // Python's `item in container`.
  static absl::StatusOr<bool> Contains(const Value& container, const Value& item);
  // Python's binary arithmetic (+ - * / // % ** and jinja2's ~).
  static absl::StatusOr<Value> Arithmetic(absl::string_view op, const Value& a, const Value& b);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  absl::StatusOr<Flow> RenderBody(const NodeList& nodes, const std::shared_ptr<Frame>& frame,
                                  std::string* out);
  absl::StatusOr<Flow> Execute(const Node& node, const std::shared_ptr<Frame>& frame,
                               std::string* out);
  absl::StatusOr<Flow> ExecuteFor(const Node& node, const std::shared_ptr<Frame>& frame,
                                  std::string* out);
  absl::Status Assign(const Target& target, const Value& value, Frame& frame);
  absl::StatusOr<Value> EvalInner(const Expr& e, const std::shared_ptr<Frame>& frame);
  absl::StatusOr<Value> CallMacro(const Node& macro, const std::shared_ptr<Frame>& defined_in,
                                  CallArgs& args);
  void NoteError(int line) {
    if (error_line_ == 0) error_line_ = line;
  }

  const absl::flat_hash_map<std::string, Value>* globals_;
  int error_line_ = 0;
  int macro_depth_ = 0;
};

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_INTERPRETER_H_
