#include "common/text/jinja/parser.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/text/jinja/builtins.h"
#include "common/text/jinja/lexer.h"
#include "common/text/jinja/parser_internal.h"

namespace specd::jinja {
namespace {

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
  for (const Expr* child :
       {e->object.get(), e->index.get(), e->start.get(), e->stop.get(), e->step.get(),
        e->left.get(), e->right.get(), e->cond.get(), e->then.get(), e->otherwise.get()}) {
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

}  // namespace

// Parses nodes until a block tag whose name is in `ends` (consumed up to the name; *end
// says which) or the end of the template (an error when `ends` is not empty).
absl::Status Parser::Subparse(std::initializer_list<absl::string_view> ends, NodeList* out,
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

absl::Status Parser::Statement(NodeList* out) {
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
  } else if (name == "call" || name == "block" || name == "extends" || name == "include" ||
             name == "import" || name == "from" || name == "autoescape" || name == "trans" ||
             name == "pluralize") {
    return Error(absl::StrCat("'{% ", name, " %}' is not supported by ", kEngine));
  } else {
    return Error(absl::StrCat("unknown tag '", name, "'"));
  }
  if (!s.ok()) return s;
  out->push_back(std::move(n));
  return absl::OkStatus();
}

absl::Status Parser::If(Node* n) {
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

absl::Status Parser::AssignTarget(Target* target, bool allow_namespace,
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
    if (paren ? IsOp(")")
              : (IsOp("=") || Cur().type == TokenType::kBlockEnd ||
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

absl::Status Parser::For(Node* n) {
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

absl::Status Parser::Set(Node* n) {
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

absl::Status Parser::Macro(Node* n) {
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
absl::Status Parser::FilterBlock(Node* n) {
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

absl::Status Parser::With(Node* n) {
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

absl::StatusOr<NodeList> ParseTemplate(absl::string_view source) {
  absl::StatusOr<std::vector<Token>> tokens = Tokenize(source);
  if (!tokens.ok()) return tokens.status();
  return Parser(*std::move(tokens)).Run();
}

}  // namespace specd::jinja
