#!/usr/bin/python3
"""Goldens for specd's Jinja engine (common/text/jinja), rendered by Python's jinja2.

jinja2 (Debian's python3-jinja2, 3.1) is the engine transformers renders chat templates with;
this script renders with the same environment transformers builds in
transformers/utils/chat_template_utils.py (_compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension, a {% generation %} tag that renders its body, tojson as json.dumps with
ensure_ascii=False, and the globals raise_exception and strftime_now. strftime_now is frozen at
FROZEN_NOW so the goldens do not depend on the day they were made; the C++ tests inject the same
instant.

Writes
  tests/fixtures/chat_templates/goldens.json  real templates x message lists
  tests/fixtures/jinja/engine_cases.json      small templates, one construct each

Run from the repository root:  /usr/bin/python3 tools/oracle/make_chat_goldens.py
"""

import datetime
import json
import os
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATES = os.path.join(ROOT, "tests", "fixtures", "chat_templates")
FROZEN_NOW = datetime.datetime(2024, 11, 5, 12, 34, 56, 789012)


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks assistant text with it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return FROZEN_NOW.strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = make_env()


def render(source, context):
    """{"output": text} or {"error": message} (raise_exception's message as it is)."""
    try:
        return {"output": ENV.from_string(source).render(**context)}
    except jinja2.exceptions.TemplateSyntaxError as e:
        return {"error": f"syntax: {e}", "syntax_error": True}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e), "raised": type(e) is jinja2.exceptions.TemplateError}
    except Exception as e:  # TypeError, ValueError, ... raised while rendering
        return {"error": f"{type(e).__name__}: {e}"}


# ---- real templates ----

# file, bos_token, eos_token (from each model's tokenizer_config.json), extra kwargs variants.
MODELS = [
    ("llama-3.1-8b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", [{}]),
    ("llama-3.2-3b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", [{}]),
    ("mistral-7b-instruct-v0.3.jinja", "<s>", "</s>", [{}]),
    ("qwen2.5-7b-instruct.jinja", None, "<|im_end|>", [{}]),
    ("qwen3.jinja", None, "<|im_end|>",
     [{}, {"enable_thinking": True}, {"enable_thinking": False}]),
    ("llama-2-7b-chat.jinja", "<s>", "</s>", [{}]),
    # More constructs (macros over tool schemas, tojson with indent, string methods, dates).
    ("hermes-3-llama-3.1-8b-tool-use.jinja", "<|begin_of_text|>", "<|im_end|>", [{}]),
    ("functionary-medium-v3.2.jinja", "<|begin_of_text|>", "<|eot_id|>", [{}]),
    ("gpt-oss-120b.jinja", None, "<|return|>", [{}, {"reasoning_effort": "high"}]),
    ("granite-3.3-2b-instruct.jinja", None, "<|end_of_text|>", [{}, {"thinking": True}]),
]

U = {"role": "user"}
A = {"role": "assistant"}
S = {"role": "system"}


def m(base, content):
    return dict(base, content=content)


CONVERSATIONS = {
    "user": [m(U, "Hello!")],
    "system_user": [m(S, "You are a helpful assistant."), m(U, "What is 2+2?")],
    "multi_turn": [m(U, "Hi"), m(A, "Hello! How can I help?"), m(U, "Tell me a joke.")],
    "system_multi_turn": [
        m(S, "Be terse."), m(U, "Name a color."), m(A, "Blue."), m(U, "Another one."),
        m(A, "Red."), m(U, "And one more?")],
    "assistant_last": [m(U, "Write a haiku."), m(A, "Autumn moonlight -\na worm digs silently")],
    "unicode": [
        m(S, "Réponds en français. 日本語も可。"),
        m(U, "Ça va? 🙂 Привет! مرحبا ¿Qué tal? ñ ü ß ﬁ İ ΣΑΣ"),
        m(A, "Très bien 👍🏽 — 谢谢!"), m(U, "👨‍👩‍👧 e\u0301 \u200b\u2028x")],
    "empty_content": [m(S, ""), m(U, ""), m(A, ""), m(U, "")],
    "whitespace": [
        m(S, "  padded system \n"), m(U, "\n\n  spaced question?  \t"),
        m(A, "  answer with spaces  "), m(U, " ok ")],
    "tricky_text": [
        m(U, "Quotes ' \" and backslash \\ and {{ not a tag }} {% neither %} {# nor #}"),
        m(A, "<|im_start|>user\nfake<|im_end|> [INST] x [/INST] <s></s>"),
        m(U, "Line1\r\nLine2\rLine3\n\n\nEnd")],
    "system_only": [m(S, "Only a system prompt.")],
    "two_users": [m(U, "First."), m(U, "Second, without an answer between.")],
    "thinking_history": [
        m(U, "What is 3*7?"),
        m(A, "<think>\n3*7 = 21.\n</think>\n\n21."),
        m(U, "And 4*5?")],
    "long_history": [x for i in range(6) for x in (m(U, f"question {i}"), m(A, f"answer {i}"))]
    + [m(U, "last question")],
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"},
                           "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}}]

TOOL_CONVERSATION = [
    m(S, "You can look up the weather."),
    m(U, "Weather in Zürich?"),
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}]},
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather",
     "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"},
    m(A, "It is 21.5 °C and clear."),
    m(U, "Thanks!")]


def chat_goldens():
    out = []
    for file, bos, eos, variants in MODELS:
        with open(os.path.join(TEMPLATES, file), encoding="utf-8") as f:
            source = f.read()
        cases = []
        convs = list(CONVERSATIONS.items()) + [("tools", TOOL_CONVERSATION)]
        for name, messages in convs:
            for gen in (True, False):
                for kwargs in variants:
                    context = {"messages": messages,
                               "tools": TOOLS if name == "tools" else None,
                               "documents": None,
                               "add_generation_prompt": gen}
                    if bos is not None:
                        context["bos_token"] = bos
                    context["eos_token"] = eos
                    context.update(kwargs)
                    case = {"name": name, "context": context}
                    case.update(render(source, context))
                    cases.append(case)
        out.append({"template": file, "cases": cases})
    return out


# ---- small templates, one construct each ----

ENGINE_CASES = [
    # Whitespace: trim_blocks, lstrip_blocks, -, +, comments, raw.
    ("trim_blocks", "{% if true %}\nyes\n{% endif %}\nafter", {}),
    ("lstrip_blocks", "a\n    {% if true %}\n    b\n    {% endif %}\nc", {}),
    ("lstrip_not_vars", "a\n    {{ 'x' }}\n  {# c #}\n", {}),
    ("minus_both", "a  \n  {%- if true -%}  \n  b  \n  {%- endif -%}  \n  c", {}),
    ("minus_vars", "a {{- 'x' -}} b\n{{ 'y' -}}\n\n z", {}),
    ("plus_keeps", "a\n  {%+ if true +%}\nb\n  {%+ endif %}\nc", {}),
    ("comment_trim", "x\n{# comment #}\ny {#- tight -#} z", {}),
    ("raw_block", "{% raw %}{{ not evaluated }} {% if %}{% endraw %}|\n  {% raw -%}  x  {%- endraw %}", {}),
    ("trailing_newline", "line\n", {}),
    ("crlf_source", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", {}),
    ("unicode_spaces", "a\u00a0\n\u3000{% if true %}\u2003b{%- endif %}", {}),
    # Literals and printing.
    ("print_types", "{{ none }}|{{ true }}|{{ false }}|{{ 42 }}|{{ -3 }}|{{ 2.5 }}|{{ 1e3 }}|{{ 1_000 }}|{{ 0x1F }}|{{ 'a' 'b' }}", {}),
    ("print_floats", "{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 0.00001 }} {{ 0.0001 }} {{ 1/3 }} {{ -0.0 }} {{ 3.0 }} {{ 2.5e-10 }} {{ 123456789.123 }}", {}),
    ("print_containers", "{{ [1, 'a', none, true, 2.0] }} {{ (1,) }} {{ (1, 'b') }} {{ {'k': 'v', 'n': [1]} }} {{ [] }} {{ {} }}", {}),
    ("print_repr_quotes", "{{ [\"it's\", 'say \"hi\"', 'both \\' \"', 'tab\\tnl\\n', 'é😀'] }}", {}),
    ("print_ctx", "{{ d }} {{ l }} {{ s }} {{ f }}", {"d": {"a": 1, "b": [True, None]}, "l": [1.5, "x"], "s": "str", "f": 0.1}),
    ("string_escapes", "{{ 'a\\nb\\tc\\\\d\\'e\\\"f\\x41\\u00e9\\U0001F600\\101\\q' }}", {}),
    ("undefined_prints_empty", "[{{ missing }}][{{ missing is defined }}][{{ missing | default('d') }}]", {}),
    ("none_prints", "{{ x }}{{ x is none }}", {"x": None}),
    # Operators.
    ("arithmetic", "{{ 7 + 2 }} {{ 7 - 2 }} {{ 7 * 2 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 2 ** 3 ** 2 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }}", {}),
    ("precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ -2 ** 2 }} {{ 1 ~ 2 * 3 }} {{ (1 + 2) ~ 3 }} {{ not 1 == 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }}", {}),
    ("bool_arith", "{{ true + 1 }} {{ true * 3 }} {{ -true }} {{ 1 == true }} {{ 1 == 1.0 }}", {}),
    ("concat_tilde", "{{ 'a' ~ 1 ~ none ~ true ~ 2.5 ~ missing ~ [1] }}", {}),
    ("string_ops", "{{ 'ab' + 'cd' }} {{ 'ab' * 3 }} {{ 2 * 'x' }} {{ [1] + [2] }} {{ [0] * 3 }} {{ 'b' in 'abc' }} {{ 'z' not in 'abc' }}", {}),
    ("logic_returns_operands", "{{ 0 or 'x' }}|{{ 'a' and 'b' }}|{{ '' and 'b' }}|{{ none or [] }}|{{ not '' }}|{{ missing or 'fallback' }}", {}),
    ("comparisons", "{{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2 }} {{ 2 <= 1.5 }} {{ 'é' > 'e' }} {{ none == none }} {{ [1] == [1.0] }} {{ {'a': 1} == {'a': 1} }} {{ (1, 2) == [1, 2] }}", {}),
    ("in_operator", "{{ 1 in [1, 2] }} {{ 'a' in {'a': 1} }} {{ 'x' in missing }} {{ 2 in (1, 2) }} {{ 'ab' in 'cabd' }}", {}),
    ("ternary", "{{ 'y' if true else 'n' }} {{ 'y' if false else 'n' }} [{{ 'y' if false }}] {{ 'a' if false else 'b' if true else 'c' }}", {}),
    # Attribute and item access.
    ("getattr_dict", "{{ d.a }} {{ d['a'] }} {{ d.b.c }} {{ d['b']['c'] }} [{{ d.zz }}] {{ d.get('a') }} {{ d.get('zz', 'dflt') }} {{ d.get('zz') }}", {"d": {"a": 1, "b": {"c": "deep"}}}),
    ("getitem_list", "{{ l[0] }} {{ l[-1] }} {{ l.0 }} [{{ l[10] }}] {{ l[1:] }} {{ l[:-1] }} {{ l[::2] }} {{ l[::-1] }} {{ l[5:] }}", {"l": [1, 2, 3, 4]}),
    ("string_index_slice", "{{ s[0] }} {{ s[-1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s[:-1] }}", {"s": "héllo→✓"}),
    ("dict_method_vs_key", "{{ d['items'] }} {{ d.keys() | list }} {{ d.values() | list }} {% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", {"d": {"items": "key", "x": 1}}),
    # Loops.
    ("for_loop_vars", "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ x }};{% endfor %}", {}),
    ("for_prev_next", "{% for x in [1, 2, 3] %}[{{ loop.previtem }}|{{ loop.nextitem }}]{% endfor %}", {}),
    ("for_cycle_changed", "{% for x in [1, 1, 2, 2, 3] %}{{ loop.cycle('a', 'b') }}{% if loop.changed(x) %}!{% endif %}{% endfor %}", {}),
    ("for_else", "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}|{% for x in missing %}x{% else %}none{% endfor %}", {}),
    ("for_filter", "{% for x in range(10) if x % 3 == 0 %}{{ x }}{{ loop.index }}/{{ loop.length }} {% endfor %}", {}),
    ("for_unpack", "{% for a, b in [[1, 2], (3, 4)] %}{{ a }}{{ b }}{% endfor %} {% for k, v in {'x': 1, 'y': 2} | items %}{{ k }}{{ v }}{% endfor %}", {}),
    ("for_dict_keys", "{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}", {}),
    ("for_break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("nested_loops", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}", {}),
    ("loop_scope", "{% set x = 5 %}{% for i in [1, 2] %}[{{ x }}]{% set x = i %}{{ x }}{% endfor %}{{ x }}", {}),
    ("loop_scope_reset", "{% for i in [1, 2, 3] %}[{{ y }}]{% set y = i %}{% endfor %}[{{ y }}]", {}),
    ("if_scope", "{% if true %}{% set q = 1 %}{% endif %}{{ q }}", {}),
    ("reversed_messages", "{% for m in msgs[::-1] %}{{ (msgs | length - 1) - loop.index0 }}{{ m }}{% endfor %}", {"msgs": ["a", "b", "c"]}),
    # Set and namespace.
    ("set_forms", "{% set a = 1 %}{% set b, c = 2, 3 %}{% set d = [a, b, c] %}{{ a }}{{ b }}{{ c }}{{ d }}{% set t = 1, 2 %}{{ t }}", {}),
    ("set_block", "{% set body %}\n  inner {{ 1 + 1 }}\n{% endset %}[{{ body }}]", {}),
    ("namespace", "{% set ns = namespace(count=0, found=false) %}{% for x in [1, 2, 3] %}{% set ns.count = ns.count + x %}{% if x == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }} {{ ns.missing is defined }}", {}),
    ("namespace_dict_arg", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}", {}),
    ("with_block", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", {}),
    # Macros.
    ("macro_basic", "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', greeting='Hi') }} {{ greet(greeting='Yo', name='Cy') }}", {}),
    ("macro_missing_arg", "{% macro m(a, b) %}[{{ a }}|{{ b }}|{{ b is defined }}]{% endmacro %}{{ m(1) }}", {}),
    ("macro_varargs_kwargs", "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, x=4) }}", {}),
    ("macro_recursion", "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1) | int }}{% endif %}{% endmacro %}{{ fact(5) }}", {}),
    ("macro_sees_caller_scope", "{% set y = 1 %}{% macro m() %}{{ y }}{% endmacro %}{% set y = 2 %}{{ m() }}", {}),
    ("macro_whitespace", "{% macro render_item_list(items, tag='required') %}\n    {%- if items is defined and items | length > 0 %}\n        {{- '<' ~ tag ~ '>' -}}\n        {%- for item in items -%}\n            {%- if loop.index > 1 %}{{- ', ' }}{% endif -%}\n            {{ '`' ~ item ~ '`' }}\n        {%- endfor -%}\n    {%- endif %}\n{% endmacro %}\n[{{ render_item_list(['a', 'b']) }}]", {}),
    # Filters.
    ("filter_trim", "[{{ '  a b \\n' | trim }}][{{ 'xxaxx' | trim('x') }}][{{ '\u3000wide\u00a0' | trim }}]", {}),
    ("filter_case", "{{ 'hello WORLD' | upper }} {{ 'Hello' | lower }} {{ 'hello big-world (x)' | title }} {{ 'hELLO wORLD' | capitalize }} {{ 'ß' | upper }} {{ 'ΣΑΣ ΟΔΟΣ' | lower }}", {}),
    ("filter_length", "{{ [1, 2] | length }} {{ 'héllo' | length }} {{ {'a': 1} | count }} {{ missing | length }}", {}),
    ("filter_default", "{{ missing | default('x') }} {{ '' | default('y') }} {{ '' | default('y', true) }} {{ none | d('z') }} {{ 0 | default(5, boolean=true) }}", {}),
    ("filter_join", "{{ [1, 'a', none] | join }} {{ ['a', 'b'] | join(', ') }} {{ users | join(';', attribute='name') }}", {"users": [{"name": "x"}, {"name": "y"}]}),
    ("filter_first_last", "{{ [3, 4] | first }} {{ [3, 4] | last }} {{ 'abc' | first }} [{{ [] | first }}] {{ {'k': 1} | first }}", {}),
    ("filter_list_string", "{{ 'ab' | list }} {{ {'a': 1} | list }} {{ 12 | string }} {{ [1] | string }} {{ none | string }}", {}),
    ("filter_int_float", "{{ '42' | int }} {{ ' 7 ' | int }} {{ '3.9' | int }} {{ 'x' | int }} {{ 'x' | int(9) }} {{ 3.9 | int }} {{ '0x1A' | int(0, 16) }} {{ '1.5' | float }} {{ 'n' | float }} {{ 2 | float }}", {}),
    ("filter_round_abs", "{{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} {{ 1.23 | round(1, 'ceil') }} {{ 1.27 | round(1, 'floor') }} {{ 3 | round }} {{ -4 | abs }} {{ -1.5 | abs }}", {}),
    ("filter_tojson", "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(ensure_ascii=true) }}|{{ x | tojson(sort_keys=true, separators=(',', ':')) }}", {"x": {"b": [1, 2.5, None, True, "é\"\n\t\\<>&'"], "a": {}, "c": [], "d": "😀\u2028\x7f"}}),
    ("filter_tojson_indent_str", "{{ [1, {'a': [2]}] | tojson(indent='\\t') }}", {}),
    ("filter_items_dictsort", "{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %} {{ d | dictsort }} {{ d | dictsort(by='value', reverse=true) }} {{ {'b': 1, 'A': 2, 'a': 3} | dictsort(true) }}", {"d": {"b": 2, "a": 3, "c": 1}}),
    ("filter_map", "{{ users | map(attribute='name') | list }} {{ users | map(attribute='age', default=0) | list }} {{ ['a', 'b'] | map('upper') | join }} {{ users | map(attribute='tags.0') | list }}", {"users": [{"name": "x", "age": 3, "tags": ["t1"]}, {"name": "y", "tags": ["t2"]}]}),
    ("filter_select_reject", "{{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3, 4] | reject('odd') | list }} {{ [0, 1, '', 'a'] | select | list }} {{ [1, 5, 9] | select('greaterthan', 4) | list }} {{ ['a', 'b'] | select('in', ['b', 'c']) | list }}", {}),
    ("filter_selectattr", "{{ msgs | selectattr('role', 'equalto', 'user') | list | length }} {{ msgs | rejectattr('role', 'eq', 'user') | map(attribute='content') | join(',') }} {{ msgs | selectattr('flag') | list | length }} {{ msgs | selectattr('flag', 'undefined') | list | length }}", {"msgs": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "flag": True}, {"role": "user", "content": "c"}]}),
    ("filter_generators", "{{ [1] | select is iterable }} {{ ([] | select) is sequence }} {% if [] | select %}truthy{% endif %} {% set g = [1, 2] | map('string') %}{{ g | list }}{{ g | list }}", {}),
    ("filter_sort_unique", "{{ ['b', 'A', 'a', 'c'] | sort }} {{ ['b', 'A', 'a'] | sort(case_sensitive=true) }} {{ [3, 1, 2] | sort(reverse=true) }} {{ users | sort(attribute='age') | map(attribute='n') | join }} {{ ['a', 'A', 'b', 'a'] | unique | list }} {{ [2, 1, 2.0, true] | unique | list }}", {"users": [{"n": "x", "age": 3}, {"n": "y", "age": 1}, {"n": "z", "age": 2}]}),
    ("filter_min_max_sum", "{{ [3, 1, 2] | min }} {{ [3, 1, 2] | max }} {{ ['b', 'A'] | min }} {{ [1, 2, 3] | sum }} {{ items | sum(attribute='v') }} {{ [[1], [2]] | sum(start=[]) }}", {"items": [{"v": 1.5}, {"v": 2}]}),
    ("filter_replace_reverse", "{{ 'aaa' | replace('a', 'b') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ 'abc' | replace('', '-') }} {{ 'héllo' | reverse }} {{ [1, 2, 3] | reverse | list }}", {}),
    ("filter_indent", "[{{ 'a\\nb\\n\\nc' | indent }}][{{ 'a\\nb' | indent(2, true) }}][{{ 'a\\n\\nb' | indent('> ', blank=true) }}][{{ '' | indent }}]", {}),
    ("filter_center_wordcount_format", "[{{ 'ab' | center(7) }}][{{ 'abc' | center(8) }}] {{ 'one two, three!' | wordcount }} {{ '%s-%05.1f|%d%%' | format('x', 3.14159, 7) }} {{ '%(a)s!' | format(a='kw') }}", {}),
    ("filter_batch", "{{ [1, 2, 3, 4, 5] | batch(2) | list }} {{ [1, 2, 3] | batch(2, 'x') | list }}", {}),
    ("filter_escape_safe", "{{ '<a & \"b\">' | e }} {{ '<x>' | safe }} {{ ('<a>' | safe) + '<b>' }} {{ '<' ~ ('<' | safe) }} {{ '<x>' | escape is escaped }}", {}),
    ("filter_attr", "{{ d | attr('x') is defined }} {{ namespace(v=3) | attr('v') }} {{ 'ab' | attr('upper') is callable }}", {"d": {"x": 1}}),
    # Tests.
    ("tests_types", "{{ 1 is number }} {{ 1.5 is float }} {{ 1 is integer }} {{ true is integer }} {{ true is boolean }} {{ 's' is string }} {{ {} is mapping }} {{ [] is sequence }} {{ 's' is iterable }} {{ 1 is iterable }} {{ none is none }} {{ range is callable }} {{ missing is sequence }}", {}),
    ("tests_values", "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }} {{ true is true }} {{ 1 is true }} {{ false is false }} {{ 'ABC' is upper }} {{ 'abc' is lower }} {{ 'Ab' is lower }}", {}),
    ("tests_comparison", "{{ 1 is eq 1 }} {{ 1 is equalto(2) }} {{ 2 is gt 1 }} {{ 2 is ge 2 }} {{ 1 is lt 2 }} {{ 1 is le 0 }} {{ 1 is ne 2 }} {{ 2 is in [1, 2] }} {{ x is sameas none }} {{ 'upper' is filter }} {{ 'odd' is test }} {{ 'nope' is filter }}", {"x": None}),
    ("tests_not", "{{ x is not defined }} {{ 1 is not string }} {{ not x is defined }} {{ none is not none }}", {}),
    # String and list methods.
    ("str_methods", "{{ ' a '.strip() }}|{{ 'xax'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ 'l1\\nl2\\r\\nl3'.splitlines() }}", {}),
    ("str_methods_2", "{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ 'hello world'.title() }}{{ 'hELLO'.capitalize() }}{{ 'aXb'.swapcase() }}|{{ 'hello'.find('l') }}{{ 'hello'.rfind('l') }}{{ 'hello'.find('z') }}{{ 'héllo'.index('l') }}{{ 'hello'.count('l') }}|{{ '-'.join(['a', 'b']) }}|{{ 'a'.replace('a', 'b') }}|{{ '12'.isdigit() }}{{ 'ab'.isalpha() }}{{ ' '.isspace() }}{{ 'AB'.isupper() }}{{ 'ab'.islower() }}", {}),
    ("str_methods_3", "{{ 'prefix-x'.removeprefix('prefix-') }}|{{ 'x.txt'.removesuffix('.txt') }}|{{ 'a'.ljust(3, '*') }}|{{ 'a'.rjust(3) }}|{{ 'a'.center(4, '-') }}|{{ '42'.zfill(5) }}|{{ 'a=b=c'.partition('=') }}|{{ 'a=b=c'.rpartition('=') }}|{{ '{} and {}'.format(1, 'x') }}|{{ '{0}{0}{name}'.format('r', name='n') }}|{{ '{:>5}|{:.2f}'.format('ab', 3.14159) }}", {}),
    ("str_split_content", "{% set c = content.split('</think>')[-1].lstrip('\\n') %}[{{ c }}][{{ content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}]", {"content": "<think>\nreason\n</think>\n\nanswer"}),
    ("list_methods", "{{ [1, 2, 1].count(1) }} {{ ['a', 'b'].index('b') }}", {}),
    ("percent_operator", "{{ '%s=%d' % ('a', 3) }} {{ '%.2f' % 3.14159 }} {{ '%5s|%-5s|' % ('r', 'l') }} {{ '%x %o %e' % (255, 8, 12345.678) }}", {}),
    # Globals.
    ("globals", "{{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ range(5, 0, -2) | list }} {{ dict(a=1, b='x') }} {{ namespace(z=1).z }}", {}),
    ("strftime_now", "{{ strftime_now('%Y-%m-%d %H:%M:%S') }} {{ strftime_now('%d %b %Y') }} {{ strftime_now('%B %d, %Y %A %j %f') }} [{{ strftime_now('%z%Z') }}]", {}),
    ("filter_block", "{% filter upper | replace('A', '4') %}\n  abc {{ 'x' }}\n{% endfilter %}|{% filter indent(2, true) %}a\nb{% endfilter %}", {}),
    ("generation_tag", "a{% generation %}b{{ 1 }}{% endgeneration %}c", {}),
    ("dict_literal_nested", "{% set d = {'a': {'b': [1, {'c': 'x'}]}, 'n': none} %}{{ d.a.b[1].c }} {{ d | tojson }}", {}),
    # Errors jinja2 raises while rendering.
    ("err_concat_binds_tighter_than_plus", "{{ 1 + 2 ~ 3 }}", {}),
    ("err_raise_exception", "{{ raise_exception('custom failure: ' ~ 42) }}", {}),
    ("err_undefined_attr", "{{ missing.attr }}", {}),
    ("err_undefined_nested", "{{ d.a.b }}", {"d": {}}),
    ("err_str_plus_int", "{{ 'a' + 1 }}", {}),
    ("err_int_plus_str", "{{ 1 + 'a' }}", {}),
    ("err_undefined_plus", "{{ missing + 1 }}", {}),
    ("err_division_by_zero", "{{ 1 / 0 }}", {}),
    ("err_unsafe_append", "{% set l = [] %}{{ l.append(1) }}", {}),
    ("err_not_iterable", "{% for x in 5 %}{% endfor %}", {}),
    ("err_ns_assign", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("err_compare_types", "{{ 1 < 'a' }}", {}),
    ("err_tojson_undefined", "{{ missing | tojson }}", {}),
    ("err_length_int", "{{ 5 | length }}", {}),
    ("err_call_string", "{{ 'a'() }}", {}),
    ("err_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    ("err_items_list", "{{ [1] | items | list }}", {}),
]


def engine_goldens():
    out = []
    for name, source, context in ENGINE_CASES:
        case = {"name": name, "template": source, "context": context}
        case.update(render(source, context))
        out.append(case)
    return out


def compact(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)


def cases_text(cases):
    """A JSON array with one case per line, so a regenerated file diffs case by case."""
    return "[\n" + ",\n".join(compact(c) for c in cases) + "\n]"


def main():
    meta = {"jinja2": jinja2.__version__, "python": sys.version.split()[0],
            "frozen_now": FROZEN_NOW.isoformat()}
    templates = ",\n".join(
        '{"template":' + compact(t["template"]) + ',"cases":' + cases_text(t["cases"]) + "}"
        for t in chat_goldens())
    write(os.path.join(TEMPLATES, "goldens.json"),
          '{"meta":' + compact(meta) + ',"templates":[\n' + templates + "]}\n")
    write(os.path.join(ROOT, "tests", "fixtures", "jinja", "engine_cases.json"),
          '{"meta":' + compact(meta) + ',"cases":' + cases_text(engine_goldens()) + "}\n")


if __name__ == "__main__":
    main()
