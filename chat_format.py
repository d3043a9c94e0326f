"""How chat messages reach a Jinja chat template, as vLLM hands them over.

Content format (vLLM's --chat-template-content-format): "string" gives a template each
message's content as one string (text parts joined by newlines); "openai" as a list of
parts, [{"type": "text", "text": ...}], for templates that loop over them (Llama 4's,
Gemma 3's, Qwen2-VL's); "auto" reads the template's Jinja syntax tree and picks "openai"
when it loops over a message's content, else "string" (vLLM's detection, done here on the
syntax tree of transformers' own chat-template environment).

Template variables (vLLM's --default-chat-template-kwargs): the server's defaults, which
a request's chat_template_kwargs override key by key.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any

import jinja2
from jinja2 import nodes

CONTENT_FORMATS = ("auto", "string", "openai")

# What every chat template receives besides its own variables, whatever the tokenizer's
# signature says (transformers takes some of them through **kwargs): a request or the
# server's defaults setting one would change what is rendered, or what comes back.
TEMPLATE_ARGUMENTS = {"tools", "chat_template", "conversation", "messages", "tokenize", "add_generation_prompt",
                      "continue_final_message"}


def compile_template(template: str) -> jinja2.Template:
    """The template as transformers compiles it for apply_chat_template: its sandboxed
    environment with its extensions (loop controls, `{% generation %}`), its filters and
    globals; jinja2.TemplateSyntaxError where transformers would refuse it. One environment
    for every reading of a template here, so what parses here is what transformers renders.
    transformers caches the compiled template by its text."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


def _inner(node: nodes.Node) -> nodes.Node:
    """What an expression reads through filters, tests and slices: `messages[1:]`,
    `messages | reverse` and `message.content is string` read `messages`, `message.content`."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _loads(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _reads(expr: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `expr` is one of `names` (key None) or its `key` (`x.key`, `x['key']`),
    through _inner's wrappers."""
    node = _inner(expr)
    if key is None:
        return _loads(node, names)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _loads(node.node, names)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _loads(node.node, names)
    return False


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" when the template loops over a message's content (`{% for part in
    message['content'] %}`, the message taken by a loop over `messages` or over a variable
    set from it, `messages[1:]` and filters included), else "string"; a template that
    does not parse is "string" (it fails when rendered, saying why). vLLM's rule."""
    try:
        tree = compile_template(template).environment.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists = {"messages"}  # and every variable set from it, transitively
    grown = True
    while grown:
        grown = False
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in lists and _reads(assign.node, lists):
                lists.add(target.name)
                grown = True
    loops = list(tree.find_all(nodes.For))
    messages = {loop.target.name for loop in loops if isinstance(loop.target, nodes.Name) and _reads(loop.iter, lists)}
    return "openai" if any(_reads(loop.iter, messages, "content") for loop in loops) else "string"


def template_in_effect(tokenizer: Any, chat_template: str | None = None, tools: list | None = None) -> str | None:
    """The Jinja text a render uses: `chat_template` (the request's or the server's), else
    the tokenizer's, chosen among its named ones for `tools` as transformers chooses; None
    for a tokenizer with none (taxirank's ByteTokenizer writes its ChatML in Python)."""
    if chat_template is not None:
        return chat_template
    get = getattr(tokenizer, "get_chat_template", None)
    if get is None:
        return None
    try:
        return get(None, tools=tools)
    except Exception:  # no template: rendering says so
        return None


def resolve_content_format(given: str, tokenizer: Any, chat_template: str | None = None,
                           tools: list | None = None) -> str:
    """"string" or "openai": `given`, or for "auto" what the template in effect reads."""
    if given != "auto":
        return given
    text = template_in_effect(tokenizer, chat_template, tools)
    return "string" if text is None else detect_content_format(text)


def check_content_format(value: Any, tokenizer: Any, flag: str = "--chat-template-content-format") -> str:
    """ValueError naming `flag` for a value that is none of CONTENT_FORMATS, or "openai"
    for a tokenizer without a Jinja template (its own rendering reads strings only)."""
    if value not in CONTENT_FORMATS:
        raise ValueError(f"{flag} must be one of {', '.join(CONTENT_FORMATS)}, got {value!r}")
    if value == "openai" and tokenizer is not None and not takes_template(tokenizer):
        raise ValueError(f"{flag} 'openai' needs a Jinja chat template; this model's {type(tokenizer).__name__} "
                         "renders string contents only")
    return value


def takes_template(tokenizer: Any) -> bool:
    """Whether the tokenizer's apply_chat_template takes another template (a Hugging Face
    tokenizer's does; taxirank's ByteTokenizer writes its own ChatML)."""
    try:
        return "chat_template" in inspect.signature(tokenizer.apply_chat_template).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def template_arguments(tokenizer: Any) -> tuple[set[str], bool]:
    """The names a request's chat_template_kwargs may not set (the render's own arguments:
    TEMPLATE_ARGUMENTS and the tokenizer's apply_chat_template parameters, such as
    return_dict, which would change what it returns) and whether the tokenizer passes
    other names on to its template as variables (a Jinja template's **kwargs)."""
    try:
        signature = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (AttributeError, TypeError, ValueError):  # no template (refused on rendering) or no signature to read
        signature = []
    own = {p.name for p in signature if p.kind is not p.VAR_KEYWORD}
    return own | TEMPLATE_ARGUMENTS, any(p.kind is p.VAR_KEYWORD for p in signature)


def check_default_kwargs(value: Any, tokenizer: Any = None) -> dict[str, Any]:
    """The server's default template variables, checked: a JSON object (text, or the dict
    already parsed) that sets none of the names a request may not set (template_arguments;
    tokenizer None: a Hugging Face tokenizer's, before the model loads), for a tokenizer
    that takes variables at all. ValueError naming the flag otherwise."""
    flag = "--default-chat-template-kwargs"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object of template variables, e.g. '{{\"enable_thinking\": false}}', "
                         f"got {json.dumps(value)[:100]}")
    if tokenizer is None:
        from transformers import PreTrainedTokenizerBase

        tokenizer = PreTrainedTokenizerBase
    reserved, takes_variables = template_arguments(tokenizer)
    taken = sorted(set(value) & reserved)
    if taken:
        raise ValueError(f"{flag} may not set {', '.join(taken)}: the render's own arguments, not template variables")
    if value and not takes_variables:
        raise ValueError(f"{flag}: this model's {type(tokenizer).__name__} takes no template variables")
    return value


# A request's values that leave the server's default in place (vLLM's merge_kwargs'
# unset_values): null, and "auto", which asks for the default.
UNSET_VALUES = (None, "auto")


def merge_kwargs(defaults: dict[str, Any] | None, request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's merge of --default-chat-template-kwargs and a request's chat_template_kwargs
    (vllm/renderers/params.py): the request's keys over the defaults; a request's null or
    "auto" leaves the default in place. With no defaults the request's variables go to the
    template as given, "auto" and null included (vLLM's ChatParams.with_defaults)."""
    if not defaults:
        return dict(request)
    return defaults | {k: v for k, v in request.items() if v not in UNSET_VALUES}
