// The parser of specd's Jinja engine as a class, shared by parser.cc (statements) and
// parser_expressions.cc (expressions, with jinja2 3.1's grammar and precedence).
#ifndef SPECD_COMMON_TEXT_JINJA_PARSER_INTERNAL_H_
#define SPECD_COMMON_TEXT_JINJA_PARSER_INTERNAL_H_

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/text/jinja/ast.h"
#include "common/text/jinja/lexer.h"

namespace specd::jinja {

inline constexpr absl::string_view kEngine = "specd's chat-template engine";

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  absl::StatusOr<NodeList> Run() {
    NodeList nodes;
    std::string end;
    if (absl::Status s = Subparse({}, &nodes, &end); !s.ok()) return s;
    return nodes;
  }

 private:
  const Token& Cur() const { return tokens_[pos_]; }
  const Token& Peek(size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  void Next() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  bool IsOp(absl::string_view op) const {
    return Cur().type == TokenType::kOperator && Cur().text == op;
  }
  bool IsName(absl::string_view name) const {
    return Cur().type == TokenType::kName && Cur().text == name;
  }
  bool SkipOp(absl::string_view op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool SkipName(absl::string_view name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case TokenType::kEof:
        return "end of template";
      case TokenType::kBlockEnd:
        return "end of statement block";
      case TokenType::kVariableEnd:
        return "end of print statement";
      case TokenType::kBlockBegin:
        return "'{%'";
      case TokenType::kVariableBegin:
        return "'{{'";
      case TokenType::kData:
        return "template data";
      case TokenType::kString:
        return "string literal";
      default:
        return absl::StrCat("'", t.text, "'");
    }
  }

  absl::Status ErrorAt(const Token& t, absl::string_view message) const {
    return absl::InvalidArgumentError(
        absl::StrCat("line ", t.line, ", column ", t.column, ": ", message));
  }
  absl::Status Error(absl::string_view message) const { return ErrorAt(Cur(), message); }
  absl::Status Unexpected(absl::string_view expected) const {
    return Error(absl::StrCat("expected ", expected, ", got ", Describe(Cur())));
  }
  absl::Status ExpectOp(absl::string_view op) {
    if (!SkipOp(op)) return Unexpected(absl::StrCat("'", op, "'"));
    return absl::OkStatus();
  }
  absl::Status ExpectBlockEnd() {
    if (Cur().type != TokenType::kBlockEnd) return Unexpected("end of statement block");
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName() {
    if (Cur().type != TokenType::kName) return Unexpected("a name");
    std::string name = Cur().text;
    Next();
    return name;
  }

  ExprPtr NewExpr(Expr::Kind kind, const Token& at) const {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->column = at.column;
    return e;
  }

  // ---- statements ----

  // ---- statements (parser.cc) ----

  // Parses nodes until a block tag whose name is in `ends` (consumed up to the name; *end
  // says which) or the end of the template (an error when `ends` is not empty).
  absl::Status Subparse(std::initializer_list<absl::string_view> ends, NodeList* out,
                        std::string* end);
  absl::Status Statement(NodeList* out);
  absl::Status If(Node* n);
  absl::Status AssignTarget(Target* target, bool allow_namespace,
                            std::initializer_list<absl::string_view> end_names);
  absl::Status For(Node* n);
  absl::Status Set(Node* n);
  absl::Status Macro(Node* n);
  // {% filter f(args) | g %}body{% endfilter %}: the body's text goes through the filters.
  absl::Status FilterBlock(Node* n);
  absl::Status With(Node* n);

  // ---- expressions (parser_expressions.cc), lowest precedence first ----

  bool AtTupleEnd(std::initializer_list<absl::string_view> extra_end) const;
  absl::StatusOr<ExprPtr> ParseTuple(bool with_condexpr,
                                     std::initializer_list<absl::string_view> extra_end,
                                     bool explicit_parentheses);
  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr);
  absl::StatusOr<ExprPtr> ParseCondition();
  absl::StatusOr<ExprPtr> ParseOr() { return ParseLogical("or"); }
  absl::StatusOr<ExprPtr> ParseLogical(absl::string_view op);
  absl::StatusOr<ExprPtr> ParseNot();
  absl::StatusOr<ExprPtr> ParseCompare();
  // Levels: 0 = + -, 1 = ~, 2 = * / // %, 3 = ** (left-associative in jinja2).
  absl::StatusOr<ExprPtr> ParseBinary(int level);
  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter);
  absl::StatusOr<ExprPtr> ParsePrimary();
  // [a, b] or {k: v}; a trailing comma is allowed.
  absl::StatusOr<ExprPtr> ParseDisplay(bool dict);
  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node);
  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node);
  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr node);
  // One subscript: an expression or a slice [start]:[stop][:[step]].
  absl::StatusOr<ExprPtr> ParseSubscribed();
  // (args, name=kwargs); fills e->items and e->kwargs.
  absl::Status ParseCallArgs(Expr* e);
  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee);
  absl::StatusOr<std::string> DottedName();
  // At `|`, or at the first filter name of a {% filter %} block.
  absl::StatusOr<ExprPtr> ParseFilter(ExprPtr node);
  absl::StatusOr<ExprPtr> ParseTest(ExprPtr node);

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
};

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_PARSER_INTERNAL_H_
