// Expressions of specd's Jinja engine's parser: jinja2 3.1's grammar, lowest precedence first
// (conditional, or, and, not, comparisons, + -, ~, * / // %, **, unary, postfix, filters and
// tests), with the checks that refuse filters, tests, methods and globals the engine lacks.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/text/jinja/builtins.h"
#include "common/text/jinja/parser_internal.h"

namespace specd::jinja {

bool Parser::AtTupleEnd(std::initializer_list<absl::string_view> extra_end) const {
  const TokenType t = Cur().type;
  if (t == TokenType::kVariableEnd || t == TokenType::kBlockEnd || t == TokenType::kEof ||
      IsOp(")")) {
    return true;
  }
  return std::any_of(extra_end.begin(), extra_end.end(),
                     [&](absl::string_view e) { return IsName(e); });
}

absl::StatusOr<ExprPtr> Parser::ParseTuple(bool with_condexpr,
                                           std::initializer_list<absl::string_view> extra_end,
                                           bool explicit_parentheses) {
  const Token& start = Cur();
  std::vector<ExprPtr> items;
  bool is_tuple = false;
  while (true) {
    if (!items.empty()) {
      if (absl::Status s = ExpectOp(","); !s.ok()) return s;
    }
    if (AtTupleEnd(extra_end)) break;
    absl::StatusOr<ExprPtr> e = ParseExpression(with_condexpr);
    if (!e.ok()) return e.status();
    items.push_back(*std::move(e));
    if (IsOp(",")) {
      is_tuple = true;
    } else {
      break;
    }
  }
  if (!is_tuple) {
    if (!items.empty()) return std::move(items[0]);
    if (!explicit_parentheses) return Unexpected("an expression");
  }
  ExprPtr t = NewExpr(Expr::Kind::kTuple, start);
  t->items = std::move(items);
  return t;
}

absl::StatusOr<ExprPtr> Parser::ParseExpression(bool with_condexpr) {
  return with_condexpr ? ParseCondition() : ParseOr();
}

absl::StatusOr<ExprPtr> Parser::ParseCondition() {
  absl::StatusOr<ExprPtr> then = ParseOr();
  if (!then.ok()) return then;
  ExprPtr e = *std::move(then);
  while (IsName("if")) {
    const Token& at = Cur();
    Next();
    absl::StatusOr<ExprPtr> cond = ParseOr();
    if (!cond.ok()) return cond;
    ExprPtr c = NewExpr(Expr::Kind::kCondition, at);
    c->then = std::move(e);
    c->cond = *std::move(cond);
    if (SkipName("else")) {
      absl::StatusOr<ExprPtr> otherwise = ParseCondition();
      if (!otherwise.ok()) return otherwise;
      c->otherwise = *std::move(otherwise);
    }
    e = std::move(c);
  }
  return e;
}

absl::StatusOr<ExprPtr> Parser::ParseLogical(absl::string_view op) {
  absl::StatusOr<ExprPtr> left = op == "or" ? ParseLogical("and") : ParseNot();
  if (!left.ok()) return left;
  ExprPtr e = *std::move(left);
  while (IsName(op)) {
    const Token& at = Cur();
    Next();
    absl::StatusOr<ExprPtr> right = op == "or" ? ParseLogical("and") : ParseNot();
    if (!right.ok()) return right;
    ExprPtr b = NewExpr(Expr::Kind::kBinary, at);
    b->name = std::string(op);
    b->left = std::move(e);
    b->right = *std::move(right);
    e = std::move(b);
  }
  return e;
}

absl::StatusOr<ExprPtr> Parser::ParseNot() {
  if (IsName("not")) {
    const Token& at = Cur();
    Next();
    absl::StatusOr<ExprPtr> operand = ParseNot();
    if (!operand.ok()) return operand;
    ExprPtr e = NewExpr(Expr::Kind::kNot, at);
    e->object = *std::move(operand);
    return e;
  }
  return ParseCompare();
}

absl::StatusOr<ExprPtr> Parser::ParseCompare() {
  const Token& at = Cur();
  absl::StatusOr<ExprPtr> left = ParseBinary(0);
  if (!left.ok()) return left;
  ExprPtr e = NewExpr(Expr::Kind::kCompare, at);
  e->left = *std::move(left);
  while (true) {
    std::string op;
    if (Cur().type == TokenType::kOperator &&
        (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" || Cur().text == "<=" ||
         Cur().text == ">" || Cur().text == ">=")) {
      op = Cur().text;
      Next();
    } else if (IsName("in")) {
      op = "in";
      Next();
    } else if (IsName("not") && Peek().type == TokenType::kName && Peek().text == "in") {
      op = "notin";
      Next();
      Next();
    } else {
      break;
    }
    absl::StatusOr<ExprPtr> right = ParseBinary(0);
    if (!right.ok()) return right;
    e->ops.push_back(op);
    e->operands.push_back(*std::move(right));
  }
  if (e->ops.empty()) return std::move(e->left);
  return e;
}

// Levels: 0 = + -, 1 = ~, 2 = * / // %, 3 = ** (left-associative in jinja2).
absl::StatusOr<ExprPtr> Parser::ParseBinary(int level) {
  static const std::vector<std::vector<absl::string_view>> kLevels = {
      {"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
  auto next_level = [&]() -> absl::StatusOr<ExprPtr> {
    return level + 1 < static_cast<int>(kLevels.size()) ? ParseBinary(level + 1) : ParseUnary(true);
  };
  absl::StatusOr<ExprPtr> left = next_level();
  if (!left.ok()) return left;
  ExprPtr e = *std::move(left);
  while (Cur().type == TokenType::kOperator) {
    const auto& ops = kLevels[level];
    if (std::find(ops.begin(), ops.end(), Cur().text) == ops.end()) break;
    const Token& at = Cur();
    Next();
    absl::StatusOr<ExprPtr> right = next_level();
    if (!right.ok()) return right;
    ExprPtr b = NewExpr(Expr::Kind::kBinary, at);
    b->name = at.text;
    b->left = std::move(e);
    b->right = *std::move(right);
    e = std::move(b);
  }
  return e;
}

absl::StatusOr<ExprPtr> Parser::ParseUnary(bool with_filter) {
  const Token& at = Cur();
  absl::StatusOr<ExprPtr> node;
  if (IsOp("-") || IsOp("+")) {
    Next();
    absl::StatusOr<ExprPtr> operand = ParseUnary(false);
    if (!operand.ok()) return operand;
    ExprPtr e = NewExpr(at.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, at);
    e->object = *std::move(operand);
    node = std::move(e);
  } else {
    node = ParsePrimary();
  }
  if (!node.ok()) return node;
  node = ParsePostfix(*std::move(node));
  if (node.ok() && with_filter) node = ParseFilterExpr(*std::move(node));
  return node;
}

absl::StatusOr<ExprPtr> Parser::ParsePrimary() {
  const Token& t = Cur();
  switch (t.type) {
    case TokenType::kName: {
      Next();
      ExprPtr e = NewExpr(Expr::Kind::kLiteral, t);
      if (t.text == "true" || t.text == "True") {
        e->value = Value::Bool(true);
      } else if (t.text == "false" || t.text == "False") {
        e->value = Value::Bool(false);
      } else if (t.text == "none" || t.text == "None") {
        e->value = Value::None();
      } else {
        e->kind = Expr::Kind::kName;
        e->name = t.text;
      }
      return e;
    }
    case TokenType::kString: {
      std::string s = t.text;
      Next();
      // Adjacent literals concatenate, as in Python.
      while (Cur().type == TokenType::kString) {
        s += Cur().text;
        Next();
      }
      ExprPtr e = NewExpr(Expr::Kind::kLiteral, t);
      e->value = Value::String(std::move(s));
      return e;
    }
    case TokenType::kInteger:
    case TokenType::kFloat: {
      Next();
      ExprPtr e = NewExpr(Expr::Kind::kLiteral, t);
      e->value =
          t.type == TokenType::kInteger ? Value::Int(t.int_value) : Value::Float(t.float_value);
      return e;
    }
    case TokenType::kOperator:
      if (t.text == "(") {
        Next();
        absl::StatusOr<ExprPtr> e = ParseTuple(true, {}, /*explicit_parentheses=*/true);
        if (!e.ok()) return e;
        if (absl::Status s = ExpectOp(")"); !s.ok()) return s;
        return e;
      }
      if (t.text == "[" || t.text == "{") return ParseDisplay(t.text == "{");
      break;
    default:
      break;
  }
  return Error(absl::StrCat("unexpected ", Describe(t)));
}

// [a, b] or {k: v}; a trailing comma is allowed.
absl::StatusOr<ExprPtr> Parser::ParseDisplay(bool dict) {
  const Token& at = Cur();
  Next();
  ExprPtr e = NewExpr(dict ? Expr::Kind::kDict : Expr::Kind::kList, at);
  const absl::string_view close = dict ? "}" : "]";
  while (!IsOp(close)) {
    if (!e->items.empty()) {
      if (absl::Status s = ExpectOp(","); !s.ok()) return s;
      if (IsOp(close)) break;
    }
    absl::StatusOr<ExprPtr> item = ParseExpression(true);
    if (!item.ok()) return item;
    e->items.push_back(*std::move(item));
    if (dict) {
      if (absl::Status s = ExpectOp(":"); !s.ok()) return s;
      absl::StatusOr<ExprPtr> value = ParseExpression(true);
      if (!value.ok()) return value;
      e->items.push_back(*std::move(value));
    }
  }
  Next();
  return e;
}

absl::StatusOr<ExprPtr> Parser::ParsePostfix(ExprPtr node) {
  while (true) {
    absl::StatusOr<ExprPtr> next;
    if (IsOp(".") || IsOp("[")) {
      next = ParseSubscript(std::move(node));
    } else if (IsOp("(")) {
      next = ParseCall(std::move(node));
    } else {
      return node;
    }
    if (!next.ok()) return next;
    node = *std::move(next);
  }
}

absl::StatusOr<ExprPtr> Parser::ParseFilterExpr(ExprPtr node) {
  while (true) {
    absl::StatusOr<ExprPtr> next;
    if (IsOp("|")) {
      next = ParseFilter(std::move(node));
    } else if (IsName("is")) {
      next = ParseTest(std::move(node));
    } else if (IsOp("(")) {
      next = ParseCall(std::move(node));
    } else {
      return node;
    }
    if (!next.ok()) return next;
    node = *std::move(next);
  }
}

absl::StatusOr<ExprPtr> Parser::ParseSubscript(ExprPtr node) {
  const Token& at = Cur();
  if (SkipOp(".")) {
    const Token& attr = Cur();
    if (attr.type == TokenType::kName) {
      Next();
      ExprPtr e = NewExpr(Expr::Kind::kGetAttr, at);
      e->object = std::move(node);
      e->name = attr.text;
      return e;
    }
    if (attr.type == TokenType::kInteger) {
      Next();
      ExprPtr e = NewExpr(Expr::Kind::kGetItem, at);
      e->object = std::move(node);
      e->index = NewExpr(Expr::Kind::kLiteral, attr);
      e->index->value = Value::Int(attr.int_value);
      return e;
    }
    return Unexpected("a name or number after '.'");
  }
  Next();  // [
  std::vector<ExprPtr> args;
  while (!IsOp("]")) {
    if (!args.empty()) {
      if (absl::Status s = ExpectOp(","); !s.ok()) return s;
    }
    absl::StatusOr<ExprPtr> arg = ParseSubscribed();
    if (!arg.ok()) return arg;
    args.push_back(*std::move(arg));
  }
  Next();
  if (args.empty()) return ErrorAt(at, "empty subscript");
  ExprPtr index;
  if (args.size() == 1) {
    index = std::move(args[0]);
  } else {
    index = NewExpr(Expr::Kind::kTuple, at);
    index->items = std::move(args);
  }
  if (index->kind == Expr::Kind::kSlice) {
    index->object = std::move(node);
    return index;
  }
  ExprPtr e = NewExpr(Expr::Kind::kGetItem, at);
  e->object = std::move(node);
  e->index = std::move(index);
  return e;
}

// One subscript: an expression or a slice [start]:[stop][:[step]].
absl::StatusOr<ExprPtr> Parser::ParseSubscribed() {
  const Token& at = Cur();
  ExprPtr start;
  if (!IsOp(":")) {
    absl::StatusOr<ExprPtr> e = ParseExpression(true);
    if (!e.ok()) return e;
    if (!IsOp(":")) return e;
    start = *std::move(e);
  }
  Next();  // :
  ExprPtr slice = NewExpr(Expr::Kind::kSlice, at);
  slice->start = std::move(start);
  if (!IsOp(":") && !IsOp("]") && !IsOp(",")) {
    absl::StatusOr<ExprPtr> e = ParseExpression(true);
    if (!e.ok()) return e;
    slice->stop = *std::move(e);
  }
  if (SkipOp(":") && !IsOp("]") && !IsOp(",")) {
    absl::StatusOr<ExprPtr> e = ParseExpression(true);
    if (!e.ok()) return e;
    slice->step = *std::move(e);
  }
  return slice;
}

// (args, name=kwargs); fills e->items and e->kwargs.
absl::Status Parser::ParseCallArgs(Expr* e) {
  if (absl::Status s = ExpectOp("("); !s.ok()) return s;
  while (!IsOp(")")) {
    if (!e->items.empty() || !e->kwargs.empty()) {
      if (absl::Status s = ExpectOp(","); !s.ok()) return s;
      if (IsOp(")")) break;
    }
    if (IsOp("*") || IsOp("**")) {
      return Error(absl::StrCat("'*args' and '**kwargs' in calls are not supported by ", kEngine));
    }
    if (Cur().type == TokenType::kName && Peek().type == TokenType::kOperator &&
        Peek().text == "=") {
      std::string name = Cur().text;
      Next();
      Next();
      absl::StatusOr<ExprPtr> value = ParseExpression(true);
      if (!value.ok()) return value.status();
      e->kwargs.emplace_back(std::move(name), *std::move(value));
    } else {
      if (!e->kwargs.empty()) return Error("a positional argument follows a keyword argument");
      absl::StatusOr<ExprPtr> value = ParseExpression(true);
      if (!value.ok()) return value.status();
      e->items.push_back(*std::move(value));
    }
  }
  Next();
  return absl::OkStatus();
}

absl::StatusOr<ExprPtr> Parser::ParseCall(ExprPtr callee) {
  const Token& at = Cur();
  if (callee->kind == Expr::Kind::kGetAttr &&
      MethodSupport(callee->name) == Support::kUnsupported) {
    return ErrorAt(at,
                   absl::StrCat("the method '", callee->name, "()' is not supported by ", kEngine));
  }
  if (callee->kind == Expr::Kind::kName && IsUnsupportedGlobal(callee->name)) {
    return ErrorAt(at,
                   absl::StrCat("the global '", callee->name, "()' is not supported by ", kEngine));
  }
  ExprPtr e = NewExpr(Expr::Kind::kCall, at);
  e->object = std::move(callee);
  if (absl::Status s = ParseCallArgs(e.get()); !s.ok()) return s;
  return e;
}

absl::StatusOr<std::string> Parser::DottedName() {
  absl::StatusOr<std::string> name = ExpectName();
  if (!name.ok()) return name;
  while (IsOp(".")) {
    Next();
    absl::StatusOr<std::string> part = ExpectName();
    if (!part.ok()) return part;
    absl::StrAppend(&*name, ".", *part);
  }
  return name;
}

// At `|`, or at the first filter name of a {% filter %} block.
absl::StatusOr<ExprPtr> Parser::ParseFilter(ExprPtr node) {
  SkipOp("|");
  const Token& at = Cur();
  absl::StatusOr<std::string> name = DottedName();
  if (!name.ok()) return name.status();
  switch (FilterSupport(*name)) {
    case Support::kUnknown:
      return ErrorAt(at, absl::StrCat("no filter named '", *name, "'"));
    case Support::kUnsupported:
      return ErrorAt(at, absl::StrCat("the filter '", *name, "' is not supported by ", kEngine));
    case Support::kSupported:
      break;
  }
  ExprPtr e = NewExpr(Expr::Kind::kFilter, at);
  e->object = std::move(node);
  e->name = *std::move(name);
  if (IsOp("(")) {
    if (absl::Status s = ParseCallArgs(e.get()); !s.ok()) return s;
  }
  return e;
}

absl::StatusOr<ExprPtr> Parser::ParseTest(ExprPtr node) {
  Next();  // is
  const bool negated = SkipName("not");
  const Token& at = Cur();
  absl::StatusOr<std::string> name = DottedName();
  if (!name.ok()) return name.status();
  switch (TestSupport(*name)) {
    case Support::kUnknown:
      return ErrorAt(at, absl::StrCat("no test named '", *name, "'"));
    case Support::kUnsupported:
      return ErrorAt(at, absl::StrCat("the test '", *name, "' is not supported by ", kEngine));
    case Support::kSupported:
      break;
  }
  ExprPtr e = NewExpr(Expr::Kind::kTest, at);
  e->object = std::move(node);
  e->name = *std::move(name);
  e->negated = negated;
  const TokenType t = Cur().type;
  if (IsOp("(")) {
    if (absl::Status s = ParseCallArgs(e.get()); !s.ok()) return s;
  } else if ((t == TokenType::kName || t == TokenType::kString || t == TokenType::kInteger ||
              t == TokenType::kFloat || IsOp("[") || IsOp("{")) &&
             !IsName("else") && !IsName("or") && !IsName("and")) {
    // One argument without parentheses: "x is divisibleby 3", "x is sameas none".
    if (IsName("is")) return Error("tests cannot be chained with 'is'");
    absl::StatusOr<ExprPtr> arg = ParsePrimary();
    if (!arg.ok()) return arg;
    arg = ParsePostfix(*std::move(arg));
    if (!arg.ok()) return arg;
    e->items.push_back(*std::move(arg));
  }
  return e;
}

}  // namespace specd::jinja
