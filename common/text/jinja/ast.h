// Syntax tree of specd's Jinja engine: what the parser builds and the interpreter walks.
#ifndef SPECD_COMMON_TEXT_JINJA_AST_H_
#define SPECD_COMMON_TEXT_JINJA_AST_H_

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/text/jinja/value.h"

namespace specd::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,    // value
    kName,       // name
    kList,       // items
    kTuple,      // items
    kDict,       // items as key, value pairs: items[2i], items[2i+1]
    kGetAttr,    // object.name
    kGetItem,    // object[index]
    kSlice,      // object[start:stop:step]; absent parts are null
    kCall,       // callee(args, kwargs)
    kFilter,     // object | name(args, kwargs)
    kTest,       // object is [not] name(args, kwargs)
    kNot,        // not operand
    kNeg,        // -operand
    kPos,        // +operand
    kBinary,     // left op right: + - * / // % ** ~ and or
    kCompare,    // left (ops[i] operands[i])...: == != < <= > >= in notin
    kCondition,  // then if cond else otherwise (otherwise may be null)
  };

  Kind kind;
  int line = 0;
  int column = 0;
  Value value;                       // kLiteral
  std::string name;                  // kName, kGetAttr, kFilter, kTest, kBinary (the operator)
  bool negated = false;              // kTest
  ExprPtr object;                    // most postfix kinds; kNot/kNeg/kPos
  ExprPtr index, start, stop, step;  // kGetItem, kSlice
  ExprPtr left, right;               // kBinary; kCompare's left
  ExprPtr cond, then, otherwise;     // kCondition
  std::vector<ExprPtr> items;        // kList, kTuple, kDict, kCall/kFilter/kTest args
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // kCall, kFilter, kTest
  std::vector<std::string> ops;                         // kCompare
  std::vector<ExprPtr> operands;                        // kCompare
};

// The variable a {% filter %} block's filter chain reads its body from; no template can name
// it (the lexer never makes a name with a '$').
inline constexpr char kFilterBlockBody[] = "$filter_body";

struct Node;
using NodeList = std::vector<std::unique_ptr<Node>>;

// Where {% set %} and {% for %} store values.
struct Target {
  std::vector<std::string> names;  // one name, or several for tuple unpacking
  bool tuple = false;              // a, b = ... (even with one name: "a, = ...")
  std::string attribute;           // {% set ns.attribute = ... %}: names[0] is the namespace
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches (cond, body), else_body
    kFor,       // target in expr [if cond]: body, else_body
    kSet,       // target = expr
    kSetBlock,  // {% set target %}body{% endset %}
    kMacro,     // name(params): body
    kBreak,
    kContinue,
    kScope,        // body in a scope of its own ({% with %}: target/exprs assignments first)
    kBody,         // body inline ({% generation %} of transformers' AssistantTracker)
    kFilterBlock,  // expr (filters applied to kFilterBlockBody) of the rendered body
  };

  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;  // kFor's filter
  Target target;
  std::vector<std::pair<ExprPtr, NodeList>> branches;
  NodeList body;
  NodeList else_body;
  std::string name;
  std::vector<MacroParam> params;
  bool uses_varargs = false;  // the macro body reads `varargs` / `kwargs`
  bool uses_kwargs = false;
  std::vector<std::pair<std::string, ExprPtr>> assignments;  // kScope ({% with a = 1 %})
};

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_AST_H_
