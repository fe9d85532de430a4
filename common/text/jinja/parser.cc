#include "common/text/jinja/parser.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/text/jinja/builtins.h"
#include "common/text/jinja/lexer.h"

namespace specd::jinja {
namespace {

constexpr absl::string_view kEngine = "specd's chat-template engine";

bool ExprUsesName(const Expr* e, absl::string_view name);

bool NodesUseName(const NodeList& nodes, absl::string_view name) {
  for (const auto& n : nodes) {
    if (ExprUsesName(n->expr.get(), name) || ExprUsesName(n->cond.get(), name) ||
        NodesUseName(n->body, name) || NodesUseName(n->else_body, name)) {
      return true;
    }
    for (const auto& [cond, body] : n->branches) {
      if (ExprUsesName(cond.get(), name) || NodesUseName(body, name)) return true;
    }
  }
  return false;
}

bool ExprUsesName(const Expr* e, absl::string_view name) {
  if (e == nullptr) return false;
  if (e->kind == Expr::Kind::kName && e->name == name) return true;
  for (const Expr* child : {e->object.get(), e->index.get(), e->start.get(), e->stop.get(),
                            e->step.get(), e->left.get(), e->right.get(), e->cond.get(),
                            e->then.get(), e->otherwise.get()}) {
    if (ExprUsesName(child, name)) return true;
  }
  for (const auto& item : e->items) {
    if (ExprUsesName(item.get(), name)) return true;
  }
  for (const auto& item : e->operands) {
    if (ExprUsesName(item.get(), name)) return true;
  }
  for (const auto& [k, v] : e->kwargs) {
    if (ExprUsesName(v.get(), name)) return true;
  }
  return false;
}

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

  // Parses nodes until a block tag whose name is in `ends` (consumed up to the name; *end
  // says which) or the end of the template (an error when `ends` is not empty).
  absl::Status Subparse(std::initializer_list<absl::string_view> ends, NodeList* out,
                        std::string* end) {
    while (true) {
      const Token& t = Cur();
      switch (t.type) {
        case TokenType::kEof:
          if (ends.size() == 0) return absl::OkStatus();
          return Error(absl::StrCat("unexpected end of template; looking for ",
                                    absl::StrJoin(ends, " or ", [](std::string* o, auto e) {
                                      absl::StrAppend(o, "'{% ", e, " %}'");
                                    })));
        case TokenType::kData: {
          auto n = std::make_unique<Node>();
          n->kind = Node::Kind::kText;
          n->line = t.line;
          n->text = t.text;
          out->push_back(std::move(n));
          Next();
          break;
        }
        case TokenType::kVariableBegin: {
          Next();
          auto n = std::make_unique<Node>();
          n->kind = Node::Kind::kOutput;
          n->line = t.line;
          absl::StatusOr<ExprPtr> e = ParseTuple(/*with_condexpr=*/true, {}, false);
          if (!e.ok()) return e.status();
          n->expr = *std::move(e);
          if (Cur().type != TokenType::kVariableEnd) return Unexpected("end of print statement");
          Next();
          out->push_back(std::move(n));
          break;
        }
        case TokenType::kBlockBegin: {
          Next();
          if (Cur().type != TokenType::kName) return Unexpected("a statement name");
          const std::string name = Cur().text;
          if (std::find(ends.begin(), ends.end(), name) != ends.end()) {
            *end = name;
            Next();
            return absl::OkStatus();
          }
          absl::Status s = Statement(out);
          if (!s.ok()) return s;
          break;
        }
        default:
          return Error(absl::StrCat("unexpected ", Describe(t)));
      }
    }
  }

  absl::Status Statement(NodeList* out) {
    const Token& t = Cur();
    const std::string name = t.text;
    auto n = std::make_unique<Node>();
    n->line = t.line;
    absl::Status s;
    if (name == "if") {
      Next();
      s = If(n.get());
    } else if (name == "for") {
      Next();
      s = For(n.get());
    } else if (name == "set") {
      Next();
      s = Set(n.get());
    } else if (name == "macro") {
      Next();
      s = Macro(n.get());
    } else if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) return Error(absl::StrCat("'", name, "' outside of a loop"));
      Next();
      n->kind = name == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      s = ExpectBlockEnd();
    } else if (name == "with") {
      Next();
      s = With(n.get());
    } else if (name == "generation") {
      // transformers' AssistantTracker tag: it marks assistant text and renders its body as is.
      Next();
      n->kind = Node::Kind::kBody;
      std::string end;
      if (s = ExpectBlockEnd(); s.ok()) s = Subparse({"endgeneration"}, &n->body, &end);
      if (s.ok()) s = ExpectBlockEnd();
    } else if (name == "filter") {
      Next();
      s = FilterBlock(n.get());
    } else if (name == "call" || name == "block" || name == "extends" ||
               name == "include" || name == "import" || name == "from" ||
               name == "autoescape" || name == "trans" || name == "pluralize") {
      return Error(absl::StrCat("'{% ", name, " %}' is not supported by ", kEngine));
    } else {
      return Error(absl::StrCat("unknown tag '", name, "'"));
    }
    if (!s.ok()) return s;
    out->push_back(std::move(n));
    return absl::OkStatus();
  }

  absl::Status If(Node* n) {
    n->kind = Node::Kind::kIf;
    while (true) {
      absl::StatusOr<ExprPtr> cond = ParseTuple(/*with_condexpr=*/false, {}, false);
      if (!cond.ok()) return cond.status();
      if (absl::Status s = ExpectBlockEnd(); !s.ok()) return s;
      NodeList body;
      std::string end;
      if (absl::Status s = Subparse({"elif", "else", "endif"}, &body, &end); !s.ok()) return s;
      n->branches.emplace_back(*std::move(cond), std::move(body));
      if (end == "elif") continue;
      if (end == "else") {
        if (absl::Status s = ExpectBlockEnd(); !s.ok()) return s;
        if (absl::Status s = Subparse({"endif"}, &n->else_body, &end); !s.ok()) return s;
      }
      return ExpectBlockEnd();
    }
  }

  absl::Status AssignTarget(Target* target, bool allow_namespace,
                            std::initializer_list<absl::string_view> end_names) {
    const bool paren = SkipOp("(");
    while (true) {
      absl::StatusOr<std::string> name = ExpectName();
      if (!name.ok()) return name.status();
      if (allow_namespace && !paren && target->names.empty() && IsOp(".")) {
        Next();
        absl::StatusOr<std::string> attr = ExpectName();
        if (!attr.ok()) return attr.status();
        target->names.push_back(*name);
        target->attribute = *attr;
        return absl::OkStatus();
      }
      target->names.push_back(*std::move(name));
      if (!SkipOp(",")) break;
      target->tuple = true;
      if (paren ? IsOp(")") : (IsOp("=") || Cur().type == TokenType::kBlockEnd ||
                                std::any_of(end_names.begin(), end_names.end(),
                                            [&](absl::string_view e) { return IsName(e); }))) {
        break;
      }
    }
    if (paren) {
      target->tuple = true;
      return ExpectOp(")");
    }
    return absl::OkStatus();
  }

  absl::Status For(Node* n) {
    n->kind = Node::Kind::kFor;
    if (absl::Status s = AssignTarget(&n->target, false, {"in"}); !s.ok()) return s;
    if (!SkipName("in")) return Unexpected("'in'");
    absl::StatusOr<ExprPtr> iter = ParseTuple(/*with_condexpr=*/false, {"recursive"}, false);
    if (!iter.ok()) return iter.status();
    n->expr = *std::move(iter);
    if (SkipName("if")) {
      absl::StatusOr<ExprPtr> cond = ParseExpression(true);
      if (!cond.ok()) return cond.status();
      n->cond = *std::move(cond);
    }
    if (IsName("recursive")) {
      return Error(absl::StrCat("recursive loops are not supported by ", kEngine));
    }
    if (absl::Status s = ExpectBlockEnd(); !s.ok()) return s;
    ++loop_depth_;
    std::string end;
    absl::Status s = Subparse({"endfor", "else"}, &n->body, &end);
    --loop_depth_;
    if (!s.ok()) return s;
    if (end == "else") {
      if (s = ExpectBlockEnd(); !s.ok()) return s;
      // The else body runs outside this loop (when it did not iterate).
      s = Subparse({"endfor"}, &n->else_body, &end);
      if (!s.ok()) return s;
    }
    return ExpectBlockEnd();
  }

  absl::Status Set(Node* n) {
    if (absl::Status s = AssignTarget(&n->target, true, {}); !s.ok()) return s;
    if (SkipOp("=")) {
      n->kind = Node::Kind::kSet;
      absl::StatusOr<ExprPtr> e = ParseTuple(/*with_condexpr=*/true, {}, false);
      if (!e.ok()) return e.status();
      n->expr = *std::move(e);
      return ExpectBlockEnd();
    }
    if (IsOp("|")) {
      return Error(absl::StrCat("filtered '{% set %}' blocks are not supported by ", kEngine));
    }
    if (n->target.tuple || !n->target.attribute.empty()) {
      return Error("a '{% set %}' block assigns to one plain name");
    }
    n->kind = Node::Kind::kSetBlock;
    if (absl::Status s = ExpectBlockEnd(); !s.ok()) return s;
    std::string end;
    if (absl::Status s = Subparse({"endset"}, &n->body, &end); !s.ok()) return s;
    return ExpectBlockEnd();
  }

  absl::Status Macro(Node* n) {
    n->kind = Node::Kind::kMacro;
    absl::StatusOr<std::string> name = ExpectName();
    if (!name.ok()) return name.status();
    n->name = *std::move(name);
    if (absl::Status s = ExpectOp("("); !s.ok()) return s;
    while (!IsOp(")")) {
      if (!n->params.empty()) {
        if (absl::Status s = ExpectOp(","); !s.ok()) return s;
        if (IsOp(")")) break;
      }
      absl::StatusOr<std::string> param = ExpectName();
      if (!param.ok()) return param.status();
      MacroParam p;
      p.name = *std::move(param);
      if (SkipOp("=")) {
        absl::StatusOr<ExprPtr> d = ParseExpression(true);
        if (!d.ok()) return d.status();
        p.default_value = *std::move(d);
      } else if (!n->params.empty() && n->params.back().default_value != nullptr) {
        return Error("a macro parameter without a default follows one with a default");
      }
      n->params.push_back(std::move(p));
    }
    Next();
    if (absl::Status s = ExpectBlockEnd(); !s.ok()) return s;
    const int saved = loop_depth_;
    loop_depth_ = 0;
    std::string end;
    absl::Status s = Subparse({"endmacro"}, &n->body, &end);
    loop_depth_ = saved;
    if (!s.ok()) return s;
    if (NodesUseName(n->body, "caller")) {
      return ErrorAt(tokens_[pos_ - 1],
                     absl::StrCat("macros using 'caller' are not supported by ", kEngine));
    }
    n->uses_varargs = NodesUseName(n->body, "varargs");
    n->uses_kwargs = NodesUseName(n->body, "kwargs");
    return ExpectBlockEnd();
  }

  // {% filter f(args) | g %}body{% endfilter %}: the body's text goes through the filters.
  absl::Status FilterBlock(Node* n) {
    n->kind = Node::Kind::kFilterBlock;
    ExprPtr body = NewExpr(Expr::Kind::kName, Cur());
    body->name = kFilterBlockBody;
    n->expr = std::move(body);
    do {
      absl::StatusOr<ExprPtr> e = ParseFilter(std::move(n->expr));
      if (!e.ok()) return e.status();
      n->expr = *std::move(e);
    } while (IsOp("|"));
    if (absl::Status s = ExpectBlockEnd(); !s.ok()) return s;
    std::string end;
    if (absl::Status s = Subparse({"endfilter"}, &n->body, &end); !s.ok()) return s;
    return ExpectBlockEnd();
  }

  absl::Status With(Node* n) {
    n->kind = Node::Kind::kScope;
    while (Cur().type != TokenType::kBlockEnd) {
      if (!n->assignments.empty()) {
        if (absl::Status s = ExpectOp(","); !s.ok()) return s;
      }
      absl::StatusOr<std::string> name = ExpectName();
      if (!name.ok()) return name.status();
      if (absl::Status s = ExpectOp("="); !s.ok()) return s;
      absl::StatusOr<ExprPtr> e = ParseExpression(true);
      if (!e.ok()) return e.status();
      n->assignments.emplace_back(*std::move(name), *std::move(e));
    }
    Next();
    std::string end;
    if (absl::Status s = Subparse({"endwith"}, &n->body, &end); !s.ok()) return s;
    return ExpectBlockEnd();
  }

  // ---- expressions (jinja2's precedence, lowest first) ----

  bool AtTupleEnd(std::initializer_list<absl::string_view> extra_end) const {
    const TokenType t = Cur().type;
    if (t == TokenType::kVariableEnd || t == TokenType::kBlockEnd || t == TokenType::kEof ||
        IsOp(")")) {
      return true;
    }
    return std::any_of(extra_end.begin(), extra_end.end(),
                       [&](absl::string_view e) { return IsName(e); });
  }

  absl::StatusOr<ExprPtr> ParseTuple(bool with_condexpr,
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

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr) {
    return with_condexpr ? ParseCondition() : ParseOr();
  }

  absl::StatusOr<ExprPtr> ParseCondition() {
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

  absl::StatusOr<ExprPtr> ParseOr() { return ParseLogical("or"); }

  absl::StatusOr<ExprPtr> ParseLogical(absl::string_view op) {
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

  absl::StatusOr<ExprPtr> ParseNot() {
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

  absl::StatusOr<ExprPtr> ParseCompare() {
    const Token& at = Cur();
    absl::StatusOr<ExprPtr> left = ParseBinary(0);
    if (!left.ok()) return left;
    ExprPtr e = NewExpr(Expr::Kind::kCompare, at);
    e->left = *std::move(left);
    while (true) {
      std::string op;
      if (Cur().type == TokenType::kOperator &&
          (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" ||
           Cur().text == "<=" || Cur().text == ">" || Cur().text == ">=")) {
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
  absl::StatusOr<ExprPtr> ParseBinary(int level) {
    static const std::vector<std::vector<absl::string_view>> kLevels = {
        {"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
    auto next_level = [&]() -> absl::StatusOr<ExprPtr> {
      return level + 1 < static_cast<int>(kLevels.size()) ? ParseBinary(level + 1)
                                                           : ParseUnary(true);
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

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
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

  absl::StatusOr<ExprPtr> ParsePrimary() {
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
        e->value = t.type == TokenType::kInteger ? Value::Int(t.int_value)
                                                 : Value::Float(t.float_value);
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
  absl::StatusOr<ExprPtr> ParseDisplay(bool dict) {
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

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
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

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
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

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr node) {
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
  absl::StatusOr<ExprPtr> ParseSubscribed() {
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
  absl::Status ParseCallArgs(Expr* e) {
    if (absl::Status s = ExpectOp("("); !s.ok()) return s;
    while (!IsOp(")")) {
      if (!e->items.empty() || !e->kwargs.empty()) {
        if (absl::Status s = ExpectOp(","); !s.ok()) return s;
        if (IsOp(")")) break;
      }
      if (IsOp("*") || IsOp("**")) {
        return Error(absl::StrCat("'*args' and '**kwargs' in calls are not supported by ",
                                  kEngine));
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

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    const Token& at = Cur();
    if (callee->kind == Expr::Kind::kGetAttr &&
        MethodSupport(callee->name) == Support::kUnsupported) {
      return ErrorAt(at, absl::StrCat("the method '", callee->name, "()' is not supported by ",
                                      kEngine));
    }
    if (callee->kind == Expr::Kind::kName && IsUnsupportedGlobal(callee->name)) {
      return ErrorAt(at, absl::StrCat("the global '", callee->name, "()' is not supported by ",
                                      kEngine));
    }
    ExprPtr e = NewExpr(Expr::Kind::kCall, at);
    e->object = std::move(callee);
    if (absl::Status s = ParseCallArgs(e.get()); !s.ok()) return s;
    return e;
  }

  absl::StatusOr<std::string> DottedName() {
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
  absl::StatusOr<ExprPtr> ParseFilter(ExprPtr node) {
    SkipOp("|");
    const Token& at = Cur();
    absl::StatusOr<std::string> name = DottedName();
    if (!name.ok()) return name.status();
    switch (FilterSupport(*name)) {
      case Support::kUnknown:
        return ErrorAt(at, absl::StrCat("no filter named '", *name, "'"));
      case Support::kUnsupported:
        return ErrorAt(at, absl::StrCat("the filter '", *name, "' is not supported by ",
                                        kEngine));
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

  absl::StatusOr<ExprPtr> ParseTest(ExprPtr node) {
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

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

absl::StatusOr<NodeList> ParseTemplate(absl::string_view source) {
  absl::StatusOr<std::vector<Token>> tokens = Tokenize(source);
  if (!tokens.ok()) return tokens.status();
  return Parser(*std::move(tokens)).Run();
}

}  // namespace specd::jinja
