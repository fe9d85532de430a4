#include "common/text/jinja/interpreter.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/text/jinja/builtins.h"

namespace specd::jinja {
namespace {

// Python's recursion limit stops runaway macros in jinja2; this is ours.
constexpr int kMaxMacroDepth = 200;

absl::Status Unsupported(absl::string_view op, const Value& a, const Value& b) {
  return TypeError(absl::StrCat("unsupported operand type(s) for ", op, ": '", a.TypeName(),
                                "' and '", b.TypeName(), "'"));
}

std::string HtmlEscape(absl::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// Python slicing of a sequence of `n` items: the indices a[start:stop:step] selects.
absl::StatusOr<std::vector<int64_t>> SliceIndices(int64_t n, const Value& start, const Value& stop,
                                                  const Value& step) {
  for (const Value* v : {&start, &stop, &step}) {
    if (!v->is_none() && !v->is_integral()) {
      return TypeError("slice indices must be integers or None or have an __index__ method");
    }
  }
  const int64_t st = step.is_none() ? 1 : step.as_int();
  if (st == 0) return absl::InvalidArgumentError("slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t dflt) -> int64_t {
    if (v.is_none()) return dflt;
    int64_t i = v.as_int();
    if (i < 0) i += n;
    if (st > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t b = clamp(start, st > 0 ? 0 : n - 1);
  const int64_t e = clamp(stop, st > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) out.push_back(i);
  return out;
}

}  // namespace

absl::Status Interpreter::Render(const NodeList& nodes, const std::shared_ptr<Frame>& frame,
                                 std::string* out) {
  absl::StatusOr<Flow> flow = RenderBody(nodes, frame, out);
  return flow.status();
}

absl::StatusOr<Interpreter::Flow> Interpreter::RenderBody(const NodeList& nodes,
                                                          const std::shared_ptr<Frame>& frame,
                                                          std::string* out) {
  for (const auto& node : nodes) {
    absl::StatusOr<Flow> flow = Execute(*node, frame, out);
    if (!flow.ok()) {
      NoteError(node->line);
      return flow;
    }
    if (*flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

absl::StatusOr<Interpreter::Flow> Interpreter::Execute(const Node& node,
                                                       const std::shared_ptr<Frame>& frame,
                                                       std::string* out) {
  switch (node.kind) {
    case Node::Kind::kText:
      *out += node.text;
      return Flow::kNormal;
    case Node::Kind::kOutput: {
      absl::StatusOr<Value> v = Eval(*node.expr, frame);
      if (!v.ok()) return v.status();
      *out += v->ToStr();
      return Flow::kNormal;
    }
    case Node::Kind::kIf:
      for (const auto& [cond, body] : node.branches) {
        absl::StatusOr<Value> c = Eval(*cond, frame);
        if (!c.ok()) return c.status();
        if (c->Truthy()) return RenderBody(body, frame, out);
      }
      return RenderBody(node.else_body, frame, out);
    case Node::Kind::kFor:
      return ExecuteFor(node, frame, out);
    case Node::Kind::kSet: {
      absl::StatusOr<Value> v = Eval(*node.expr, frame);
      if (!v.ok()) return v.status();
      if (absl::Status s = Assign(node.target, *v, *frame); !s.ok()) return s;
      return Flow::kNormal;
    }
    case Node::Kind::kSetBlock: {
      std::string text;
      absl::StatusOr<Flow> f = RenderBody(node.body, std::make_shared<Frame>(frame), &text);
      if (!f.ok()) return f;
      frame->Set(node.target.names[0], Value::String(std::move(text)));
      return Flow::kNormal;
    }
    case Node::Kind::kMacro: {
      const Node* macro = &node;
      std::shared_ptr<Frame> defined_in = frame;
      frame->Set(node.name, Value::Callable(node.name, [macro, defined_in](Interpreter& interp,
                                                                           CallArgs& args) {
                   return interp.CallMacro(*macro, defined_in, args);
                 }));
      return Flow::kNormal;
    }
    case Node::Kind::kBreak:
      return Flow::kBreak;
    case Node::Kind::kContinue:
      return Flow::kContinue;
    case Node::Kind::kScope: {
      auto scope = std::make_shared<Frame>(frame);
      for (const auto& [name, expr] : node.assignments) {
        absl::StatusOr<Value> v = Eval(*expr, frame);
        if (!v.ok()) return v.status();
        scope->Set(name, *std::move(v));
      }
      return RenderBody(node.body, scope, out);
    }
    case Node::Kind::kBody:
      return RenderBody(node.body, frame, out);
    case Node::Kind::kFilterBlock: {
      auto scope = std::make_shared<Frame>(frame);
      std::string text;
      absl::StatusOr<Flow> f = RenderBody(node.body, scope, &text);
      if (!f.ok()) return f;
      scope->Set(kFilterBlockBody, Value::String(std::move(text)));
      absl::StatusOr<Value> v = Eval(*node.expr, scope);
      if (!v.ok()) return v.status();
      *out += v->ToStr();
      return Flow::kNormal;
    }
  }
  return Flow::kNormal;
}

absl::Status Interpreter::Assign(const Target& target, const Value& value, Frame& frame) {
  if (!target.attribute.empty()) {
    const Value* ns = frame.Lookup(target.names[0]);
    if (ns == nullptr || !ns->is_namespace()) {
      return absl::InvalidArgumentError("cannot assign attribute on non-namespace object");
    }
    ns->mutable_namespace().Set(Value::String(target.attribute), value);
    return absl::OkStatus();
  }
  if (!target.tuple) {
    frame.Set(target.names[0], value);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<Value>> items = Iterate(value);
  if (!items.ok()) {
    return TypeError(absl::StrCat("cannot unpack non-iterable ", value.TypeName(), " object"));
  }
  const size_t want = target.names.size();
  if (items->size() > want) {
    return absl::InvalidArgumentError(
        absl::StrCat("too many values to unpack (expected ", want, ")"));
  }
  if (items->size() < want) {
    return absl::InvalidArgumentError(
        absl::StrCat("not enough values to unpack (expected ", want, ", got ", items->size(), ")"));
  }
  for (size_t i = 0; i < want; ++i) frame.Set(target.names[i], (*items)[i]);
  return absl::OkStatus();
}

absl::StatusOr<Interpreter::Flow> Interpreter::ExecuteFor(const Node& node,
                                                          const std::shared_ptr<Frame>& frame,
                                                          std::string* out) {
  absl::StatusOr<Value> iterable = Eval(*node.expr, frame);
  if (!iterable.ok()) return iterable.status();
  absl::StatusOr<std::vector<Value>> all = Iterate(*iterable);
  if (!all.ok()) return all.status();
  auto items = std::make_shared<std::vector<Value>>();
  if (node.cond == nullptr) {
    *items = *std::move(all);
  } else {
    // `for x in xs if cond`: the filter sees the loop variable but no `loop` yet.
    for (Value& item : *all) {
      auto scope = std::make_shared<Frame>(frame);
      if (absl::Status s = Assign(node.target, item, *scope); !s.ok()) return s;
      absl::StatusOr<Value> keep = Eval(*node.cond, scope);
      if (!keep.ok()) return keep.status();
      if (keep->Truthy()) items->push_back(std::move(item));
    }
  }
  if (items->empty()) return RenderBody(node.else_body, frame, out);
  auto loop = std::make_shared<LoopData>();
  loop->items = items;
  const Value loop_value = Value::Loop(loop);
  for (size_t i = 0; i < items->size(); ++i) {
    loop->index0 = static_cast<int64_t>(i);
    auto scope = std::make_shared<Frame>(frame);
    if (absl::Status s = Assign(node.target, (*items)[i], *scope); !s.ok()) return s;
    scope->Set("loop", loop_value);
    absl::StatusOr<Flow> flow = RenderBody(node.body, scope, out);
    if (!flow.ok()) return flow;
    if (*flow == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

absl::StatusOr<Value> Interpreter::CallMacro(const Node& macro,
                                             const std::shared_ptr<Frame>& defined_in,
                                             CallArgs& args) {
  if (macro_depth_ >= kMaxMacroDepth) {
    return absl::InvalidArgumentError("maximum recursion depth exceeded in macro calls");
  }
  auto scope = std::make_shared<Frame>(defined_in);
  std::vector<bool> bound(macro.params.size(), false);
  std::vector<Value> varargs;
  for (size_t i = 0; i < args.positional.size(); ++i) {
    if (i < macro.params.size()) {
      scope->Set(macro.params[i].name, args.positional[i]);
      bound[i] = true;
    } else if (macro.uses_varargs) {
      varargs.push_back(args.positional[i]);
    } else {
      return TypeError(absl::StrCat("macro '", macro.name, "' takes not more than ",
                                    macro.params.size(), " argument(s)"));
    }
  }
  auto kwargs = std::make_shared<DictData>();
  for (auto& [name, value] : args.keyword) {
    size_t i = 0;
    while (i < macro.params.size() && macro.params[i].name != name) ++i;
    if (i < macro.params.size()) {
      if (bound[i]) {
        return TypeError(
            absl::StrCat("macro '", macro.name, "' got multiple values for argument '", name, "'"));
      }
      scope->Set(name, value);
      bound[i] = true;
    } else if (macro.uses_kwargs) {
      kwargs->Set(Value::String(name), value);
    } else {
      return TypeError(
          absl::StrCat("macro '", macro.name, "' takes no keyword argument '", name, "'"));
    }
  }
  for (size_t i = 0; i < macro.params.size(); ++i) {
    if (bound[i]) continue;
    const MacroParam& p = macro.params[i];
    if (p.default_value == nullptr) {
      scope->Set(p.name,
                 Value::Undefined(absl::StrCat("parameter '", p.name, "' was not provided")));
      continue;
    }
    absl::StatusOr<Value> v = Eval(*p.default_value, scope);
    if (!v.ok()) return v.status();
    scope->Set(p.name, *std::move(v));
  }
  if (macro.uses_varargs) scope->Set("varargs", Value::Tuple(std::move(varargs)));
  if (macro.uses_kwargs) scope->Set("kwargs", Value::Dict(std::move(kwargs)));
  std::string out;
  ++macro_depth_;
  absl::StatusOr<Flow> flow = RenderBody(macro.body, scope, &out);
  --macro_depth_;
  if (!flow.ok()) return flow.status();
  return Value::String(std::move(out));
}

absl::StatusOr<Value> Interpreter::Eval(const Expr& e, const std::shared_ptr<Frame>& frame) {
  absl::StatusOr<Value> v = EvalInner(e, frame);
  if (!v.ok()) NoteError(e.line);
  return v;
}

absl::StatusOr<Value> Interpreter::Call(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) return UndefinedError(callee);
  if (!callee.is_callable()) {
    return TypeError(absl::StrCat("'", callee.TypeName(), "' object is not callable"));
  }
  return callee.callable().call(*this, args);
}

absl::StatusOr<Value> Interpreter::EvalInner(const Expr& e, const std::shared_ptr<Frame>& frame) {
  auto eval_list = [&](const std::vector<ExprPtr>& exprs) -> absl::StatusOr<std::vector<Value>> {
    std::vector<Value> out;
    out.reserve(exprs.size());
    for (const auto& x : exprs) {
      absl::StatusOr<Value> v = Eval(*x, frame);
      if (!v.ok()) return v.status();
      out.push_back(*std::move(v));
    }
    return out;
  };
  auto eval_args = [&](CallArgs* args) -> absl::Status {
    absl::StatusOr<std::vector<Value>> pos = eval_list(e.items);
    if (!pos.ok()) return pos.status();
    args->positional = *std::move(pos);
    for (const auto& [name, x] : e.kwargs) {
      absl::StatusOr<Value> v = Eval(*x, frame);
      if (!v.ok()) return v.status();
      args->keyword.emplace_back(name, *std::move(v));
    }
    return absl::OkStatus();
  };

  switch (e.kind) {
    case Expr::Kind::kLiteral:
      return e.value;
    case Expr::Kind::kName: {
      if (const Value* v = frame->Lookup(e.name)) return *v;
      const auto it = globals_->find(e.name);
      if (it != globals_->end()) return it->second;
      return Value::Undefined(absl::StrCat("'", e.name, "' is undefined"));
    }
    case Expr::Kind::kList:
    case Expr::Kind::kTuple: {
      absl::StatusOr<std::vector<Value>> items = eval_list(e.items);
      if (!items.ok()) return items.status();
      return e.kind == Expr::Kind::kList ? Value::List(*std::move(items))
                                         : Value::Tuple(*std::move(items));
    }
    case Expr::Kind::kDict: {
      absl::StatusOr<std::vector<Value>> items = eval_list(e.items);
      if (!items.ok()) return items.status();
      auto dict = std::make_shared<DictData>();
      for (size_t i = 0; i + 1 < items->size(); i += 2) dict->Set((*items)[i], (*items)[i + 1]);
      return Value::Dict(std::move(dict));
    }
    case Expr::Kind::kGetAttr: {
      absl::StatusOr<Value> object = Eval(*e.object, frame);
      if (!object.ok()) return object;
      if (object->is_undefined()) return UndefinedError(*object);
      return GetAttribute(*object, e.name);
    }
    case Expr::Kind::kGetItem: {
      absl::StatusOr<Value> object = Eval(*e.object, frame);
      if (!object.ok()) return object;
      absl::StatusOr<Value> key = Eval(*e.index, frame);
      if (!key.ok()) return key;
      if (object->is_undefined()) return UndefinedError(*object);
      return GetItem(*object, *key);
    }
    case Expr::Kind::kSlice: {
      absl::StatusOr<Value> object = Eval(*e.object, frame);
      if (!object.ok()) return object;
      Value parts[3] = {Value::None(), Value::None(), Value::None()};
      const Expr* exprs[3] = {e.start.get(), e.stop.get(), e.step.get()};
      for (int i = 0; i < 3; ++i) {
        if (exprs[i] == nullptr) continue;
        absl::StatusOr<Value> v = Eval(*exprs[i], frame);
        if (!v.ok()) return v;
        parts[i] = *std::move(v);
      }
      if (object->is_undefined()) return UndefinedError(*object);
      if (object->is_string()) {
        const std::vector<uint32_t> cps = DecodeUtf8(object->str());
        absl::StatusOr<std::vector<int64_t>> idx =
            SliceIndices(static_cast<int64_t>(cps.size()), parts[0], parts[1], parts[2]);
        if (!idx.ok()) return idx.status();
        std::string out;
        for (int64_t i : *idx) AppendUtf8(cps[i], &out);
        return Value::String(std::move(out), object->markup());
      }
      if (!object->is_sequence()) {
        return TypeError(absl::StrCat("'", object->TypeName(), "' object is not subscriptable"));
      }
      absl::StatusOr<std::vector<int64_t>> idx =
          SliceIndices(static_cast<int64_t>(object->items().size()), parts[0], parts[1], parts[2]);
      if (!idx.ok()) return idx.status();
      std::vector<Value> out;
      for (int64_t i : *idx) out.push_back(object->items()[i]);
      return object->kind() == Value::Kind::kList ? Value::List(std::move(out))
                                                  : Value::Tuple(std::move(out));
    }
    case Expr::Kind::kCall: {
      absl::StatusOr<Value> callee = Eval(*e.object, frame);
      if (!callee.ok()) return callee;
      CallArgs args;
      if (absl::Status s = eval_args(&args); !s.ok()) return s;
      return Call(*callee, args);
    }
    case Expr::Kind::kFilter: {
      absl::StatusOr<Value> object = Eval(*e.object, frame);
      if (!object.ok()) return object;
      CallArgs args;
      if (absl::Status s = eval_args(&args); !s.ok()) return s;
      return ApplyFilter(*this, e.name, *object, args);
    }
    case Expr::Kind::kTest: {
      absl::StatusOr<Value> object = Eval(*e.object, frame);
      if (!object.ok()) return object;
      CallArgs args;
      if (absl::Status s = eval_args(&args); !s.ok()) return s;
      absl::StatusOr<bool> r = ApplyTest(*this, e.name, *object, args);
      if (!r.ok()) return r.status();
      return Value::Bool(*r != e.negated);
    }
    case Expr::Kind::kNot: {
      absl::StatusOr<Value> v = Eval(*e.object, frame);
      if (!v.ok()) return v;
      return Value::Bool(!v->Truthy());
    }
    case Expr::Kind::kNeg:
    case Expr::Kind::kPos: {
      absl::StatusOr<Value> v = Eval(*e.object, frame);
      if (!v.ok()) return v;
      if (v->is_undefined()) return UndefinedError(*v);
      const char* op = e.kind == Expr::Kind::kNeg ? "-" : "+";
      if (!v->is_number()) {
        return TypeError(
            absl::StrCat("bad operand type for unary ", op, ": '", v->TypeName(), "'"));
      }
      if (e.kind == Expr::Kind::kPos) return v->is_bool() ? Value::Int(v->as_int()) : *v;
      if (v->is_integral()) return Value::Int(-v->as_int());
      return Value::Float(-v->as_double());
    }
    case Expr::Kind::kBinary: {
      absl::StatusOr<Value> left = Eval(*e.left, frame);
      if (!left.ok()) return left;
      if (e.name == "and" || e.name == "or") {
        // Python returns the deciding operand, not a bool.
        if (left->Truthy() == (e.name == "or")) return left;
        return Eval(*e.right, frame);
      }
      absl::StatusOr<Value> right = Eval(*e.right, frame);
      if (!right.ok()) return right;
      return Arithmetic(e.name, *left, *right);
    }
    case Expr::Kind::kCompare: {
      absl::StatusOr<Value> left = Eval(*e.left, frame);
      if (!left.ok()) return left;
      Value a = *std::move(left);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        absl::StatusOr<Value> right = Eval(*e.operands[i], frame);
        if (!right.ok()) return right;
        const std::string& op = e.ops[i];
        absl::StatusOr<bool> r;
        if (op == "==") {
          r = Equals(a, *right);
        } else if (op == "!=") {
          r = !Equals(a, *right);
        } else if (op == "<") {
          r = LessThan(a, *right);
        } else if (op == ">") {
          r = LessThan(*right, a);
        } else if (op == "<=" || op == ">=") {
          const bool le = op == "<=";
          r = LessThan(le ? a : *right, le ? *right : a);
          if (r.ok() && !*r) r = Equals(a, *right);
        } else {
          r = Contains(*right, a);
          if (r.ok() && op == "notin") r = !*r;
        }
        if (!r.ok()) return r.status();
        if (!*r) return Value::Bool(false);
        a = *std::move(right);
      }
      return Value::Bool(true);
    }
    case Expr::Kind::kCondition: {
      absl::StatusOr<Value> c = Eval(*e.cond, frame);
      if (!c.ok()) return c;
      if (c->Truthy()) return Eval(*e.then, frame);
      if (e.otherwise != nullptr) return Eval(*e.otherwise, frame);
      return Value::Undefined(absl::StrCat("the inline if-expression on line ", e.line,
                                           " evaluated to false and no else section was defined."));
    }
  }
  return absl::InternalError("unknown expression");
}

absl::StatusOr<std::vector<Value>> Interpreter::Iterate(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return std::vector<Value>();
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return value.items();
    case Value::Kind::kDict: {
      std::vector<Value> keys;
      for (const auto& [k, v] : value.dict().items) keys.push_back(k);
      return keys;
    }
    case Value::Kind::kIterator: {
      IteratorData& it = value.iterator();
      std::vector<Value> rest(it.items.begin() + it.next, it.items.end());
      it.next = it.items.size();
      return rest;
    }
    case Value::Kind::kLoop:
      return *value.loop().items;
    case Value::Kind::kString: {
      std::vector<Value> chars;
      for (uint32_t cp : DecodeUtf8(value.str())) {
        std::string c;
        AppendUtf8(cp, &c);
        chars.push_back(Value::String(std::move(c)));
      }
      return chars;
    }
    default:
      return TypeError(absl::StrCat("'", value.TypeName(), "' object is not iterable"));
  }
}

absl::StatusOr<bool> Interpreter::Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        return TypeError(
            absl::StrCat("'in <string>' requires string as left operand, not ", item.TypeName()));
      }
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      for (const Value& v : container.items()) {
        if (Equals(v, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return container.dict().Find(item) != nullptr;
    case Value::Kind::kIterator: {
      // Consumes up to the match, as Python does.
      IteratorData& it = container.iterator();
      while (it.next < it.items.size()) {
        if (Equals(it.items[it.next++], item)) return true;
      }
      return false;
    }
    default:
      return TypeError(
          absl::StrCat("argument of type '", container.TypeName(), "' is not iterable"));
  }
}

absl::StatusOr<Value> Interpreter::Arithmetic(absl::string_view op, const Value& a,
                                              const Value& b) {
  if (op == "~") {
    return Value::String(absl::StrCat(a.ToStr(), b.ToStr()));
  }
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  const bool ints = a.is_integral() && b.is_integral();
  const bool numbers = a.is_number() && b.is_number();
  if (op == "+") {
    if (ints) {
      int64_t r;
      if (__builtin_add_overflow(a.as_int(), b.as_int(), &r)) {
        return absl::InvalidArgumentError("integer overflow");
      }
      return Value::Int(r);
    }
    if (numbers) return Value::Float(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      // markupsafe.Markup escapes what is added to it.
      if (a.markup() != b.markup()) {
        return Value::String(
            a.markup() ? a.str() + HtmlEscape(b.str()) : HtmlEscape(a.str()) + b.str(), true);
      }
      return Value::String(a.str() + b.str(), a.markup());
    }
    if (a.kind() == b.kind() && a.is_sequence()) {
      std::vector<Value> items = a.items();
      items.insert(items.end(), b.items().begin(), b.items().end());
      return a.kind() == Value::Kind::kList ? Value::List(std::move(items))
                                            : Value::Tuple(std::move(items));
    }
    if (a.is_string() || a.is_sequence()) {
      return TypeError(absl::StrCat("can only concatenate ", a.TypeName(), " (not \"", b.TypeName(),
                                    "\") to ", a.TypeName()));
    }
    return Unsupported("+", a, b);
  }
  if (op == "*") {
    if (ints) {
      int64_t r;
      if (__builtin_mul_overflow(a.as_int(), b.as_int(), &r)) {
        return absl::InvalidArgumentError("integer overflow");
      }
      return Value::Int(r);
    }
    if (numbers) return Value::Float(a.as_double() * b.as_double());
    const Value* seq = a.is_integral() ? &b : &a;
    const Value* count = a.is_integral() ? &a : &b;
    if (count->is_integral() && (seq->is_string() || seq->is_sequence())) {
      const int64_t n = std::max<int64_t>(0, count->as_int());
      if (n > 1000000) return absl::InvalidArgumentError("repetition count is too large");
      if (seq->is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq->str();
        return Value::String(std::move(out));
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < n; ++i) {
        items.insert(items.end(), seq->items().begin(), seq->items().end());
      }
      return seq->kind() == Value::Kind::kList ? Value::List(std::move(items))
                                               : Value::Tuple(std::move(items));
    }
    return Unsupported("*", a, b);
  }
  if (op == "%" && a.is_string()) {
    absl::StatusOr<std::string> s = PercentFormat(a.str(), b);
    if (!s.ok()) return s.status();
    return Value::String(*std::move(s));
  }
  if (!numbers) return Unsupported(op, a, b);
  if (op == "-") {
    if (ints) {
      int64_t r;
      if (__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) {
        return absl::InvalidArgumentError("integer overflow");
      }
      return Value::Int(r);
    }
    return Value::Float(a.as_double() - b.as_double());
  }
  if (op == "/") {
    if (b.as_double() == 0) return absl::InvalidArgumentError("division by zero");
    return Value::Float(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (ints) {
      const int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) return absl::InvalidArgumentError("integer division or modulo by zero");
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) {
        --q;
        r += y;
      }
      return Value::Int(op == "//" ? q : r);
    }
    const double x = a.as_double(), y = b.as_double();
    if (y == 0) {
      return absl::InvalidArgumentError(op == "//" ? "float floor division by zero"
                                                   : "float modulo");
    }
    double r = std::fmod(x, y);
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    if (op == "%") return Value::Float(r);
    return Value::Float(std::floor((x - r) / y + 0.5));
  }
  if (op == "**") {
    if (ints && b.as_int() >= 0) {
      const int64_t base = a.as_int();
      if (base == 0 || base == 1) return Value::Int(b.as_int() == 0 ? 1 : base);
      if (base == -1) return Value::Int(b.as_int() % 2 == 0 ? 1 : -1);
      int64_t r = 1;
      for (int64_t i = 0; i < b.as_int(); ++i) {
        if (__builtin_mul_overflow(r, a.as_int(), &r)) {
          return absl::InvalidArgumentError("integer overflow");
        }
      }
      return Value::Int(r);
    }
    return Value::Float(std::pow(a.as_double(), b.as_double()));
  }
  return Unsupported(op, a, b);
}

}  // namespace specd::jinja
