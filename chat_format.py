"""How chat messages reach a Jinja chat template, as vLLM hands them over.

Content format (vLLM's --chat-template-content-format): "string" gives a template each
message's content as one string (text parts joined by newlines); "openai" as a list of
parts, [{"type": "text", "text": ...}], for templates that loop over them (Llama 4's,
Gemma 3's, Qwen2-VL's); "auto" reads the template's Jinja syntax tree and picks "openai"
when it loops over a message's content, else "string" (vLLM's detection, done here on the
syntax tree of transformers' own chat-template environment).

Template variables (vLLM's --default-chat-template-kwargs): the server's defaults, which
a request's chat_template_kwargs override key by key.

Rendering (render_chat): a chat request's messages checked as vLLM hands them over (roles,
text parts, tool calls, reasoning) and rendered with its tools and variables; what a
request gets wrong is protocol.py's ApiError, a 400 (LLM.chat's ValueError offline).
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2 import nodes

from protocol import JSON_TYPE, ApiError, field, loads_checked

if TYPE_CHECKING:
    from tool_parsers import ToolChoice

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


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's and vLLM's


def chat_tools(choice: ToolChoice | None, tools: list[dict] | None,
               exclude_tools_when_tool_choice_none: bool) -> list[dict] | None:
    """The tools a chat request's template renders, from protocol.tool_choice() (choice, and
    the request's tools): all of them; with tool_choice "none" (choice None) too (the model
    sees what exists, and calls nothing), as vLLM, unless exclude_tools_when_tool_choice_none
    (its --exclude-tools-when-tool-choice-none)."""
    return None if choice is None and exclude_tools_when_tool_choice_none else tools


def parse_messages(body: dict, tokenizer: Any, tools: list[dict] | None = None, chat_template: str | None = None,
                   trust_request_chat_template: bool = False, content_format: str = "auto",
                   default_kwargs: dict | None = None) -> list[int]:
    """render_chat's text as token ids: the template writes BOS and the other special tokens
    it wants, so the tokenizer adds its own on top only with add_special_tokens true
    (vLLM's chat and /tokenize requests, default false)."""
    special = field(body, "add_special_tokens", (bool,), False)
    text = render_chat(body, tokenizer, tools, chat_template, trust_request_chat_template, content_format,
                       default_kwargs)
    return tokenizer.encode(text, add_special_tokens=special)


def render_chat(body: dict, tokenizer: Any, tools: list[dict] | None = None, chat_template: str | None = None,
                trust_request_chat_template: bool = False, content_format: str = "auto",
                default_kwargs: dict | None = None) -> str:
    """Chat messages through the model's chat template, as text; tools: the definitions the
    template gets (chat_tools(), protocol.rendered_tools(); None: none), [] passed as it is,
    as transformers does.
    chat_template: the server's --chat-template instead of the model's; a request's own
    `chat_template` only with trust_request_chat_template (vLLM's flag; else its 400).
    content_format: how contents reach the template (CONTENT_FORMATS; vLLM's
    --chat-template-content-format); default_kwargs: template variables the request's
    chat_template_kwargs override (template_variables; vLLM's --default-chat-template-kwargs)."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    if tokenizer is None:
        raise ApiError("this model has no tokenizer, so no chat template: use /v1/completions with token ids",
                       param="messages")
    chat, texts = [], []  # texts: each message's text parts, for the "openai" content format
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        extra = {}  # a tool conversation's fields, for a template that renders them (as vLLM)
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list) or not all(isinstance(c, dict) for c in m["tool_calls"]):
                raise ApiError(f"messages[{i}].tool_calls must be an array of objects", param="messages")
            if m["tool_calls"]:  # none: the template's plain assistant path, as vLLM drops an empty list
                extra["tool_calls"] = [_template_call(c, i) for c in m["tool_calls"]]
        if isinstance(m, dict) and ((m.get("role") == "assistant" and content is None) or "content" not in m):
            # OpenAI's optional assistant content (null beside tool calls, or in an answer
            # that was all reasoning, sent back as history), or any role's left out (vLLM's
            # CustomChatCompletionMessageParam): no parts, as vLLM
            content = []
        if isinstance(m, dict) and m.get("name") is not None:  # a participant's name: vLLM hands it to the template
            if not isinstance(m["name"], str):
                raise ApiError(f"messages[{i}].name must be a string", param="messages")
            extra["name"] = m["name"]
        if isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise ApiError(f"messages[{i}].tool_call_id must be a string", param="messages")
            extra["tool_call_id"] = m["tool_call_id"]
        if isinstance(m, dict) and m.get("role") == "assistant":  # its thinking, for templates that show it
            reasoning = m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise ApiError(f"messages[{i}].reasoning must be a string", param="messages")
                extra |= {"reasoning": reasoning, "reasoning_content": reasoning}  # both names, as vLLM
        parts = [content]
        if isinstance(content, list):
            parts = [text_part(p, i) for p in content]
            content = "\n".join(parts)  # vLLM's join: the parts stay apart
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(f"messages[{i}] must be an object with string 'role' and 'content'", param="messages")
        # Any role reaches the template, as vLLM hands them over: templates have their own
        # (Llama 3's "ipython" for tool results), and one that refuses a role is a 400 saying so.
        if not m["role"]:
            raise ApiError(f"messages[{i}]: 'role' must be a non-empty string", param="messages")
        chat.append({"role": m["role"], "content": content, **extra})
        texts.append(parts)
    # vLLM's extras, as LLM.chat takes them: continue the last message instead of opening a
    # new assistant turn (a prefill), and the template's own variables.
    add_generation_prompt = field(body, "add_generation_prompt", (bool,), True)
    continue_final_message = field(body, "continue_final_message", (bool,), False)
    if add_generation_prompt and continue_final_message:
        raise ApiError("'continue_final_message' needs 'add_generation_prompt': false (the first continues the "
                       "last message, the second opens a new assistant turn)", param="continue_final_message")
    # Template variables only: none of apply_chat_template's own arguments (return_dict,
    # tokenize, ... would change what it returns). Stricter than vLLM, which lets them through.
    own, takes_variables = template_arguments(tokenizer)  # the latter: a Jinja template's variables
    taken = sorted(set(field(body, "chat_template_kwargs", (dict,), {})) & own)
    if taken:
        raise ApiError(f"chat_template_kwargs may not set {', '.join(taken)}", param="chat_template_kwargs")
    effort = field(body, "reasoning_effort", (str,))
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort[:40]!r}",
                       param="reasoning_effort")
    kw = template_variables(body, default_kwargs, effort=takes_variables)
    if kw and not takes_variables:  # a fixed template (taxirank's ByteTokenizer): no variable reaches it
        raise ApiError(f"this model's {type(tokenizer).__name__} takes no template variables, got "
                       f"{', '.join(sorted(kw))[:200]}", param="chat_template_kwargs")
    if continue_final_message:  # only when set: ByteTokenizer's template takes no such argument
        kw["continue_final_message"] = True
    if body.get("chat_template") is not None:
        if not trust_request_chat_template:  # vLLM's words
            raise ApiError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                           "Refused request with untrusted chat template.", param="chat_template")
        chat_template = field(body, "chat_template", (str,))
    if chat_template is not None:
        if not takes_template(tokenizer):  # taxirank's ByteTokenizer: its own ChatML
            raise ApiError("this model's tokenizer takes no other chat template", param="chat_template")
        kw["chat_template"] = chat_template
    try:
        if tools is not None:
            kw["tools"] = tools
        if resolve_content_format(content_format, tokenizer, kw.get("chat_template"),
                                              kw.get("tools")) == "openai":
            # vLLM's "openai" form: every content a list of text parts, except a tool
            # result's, which vLLM hands over joined (most templates print it whole)
            for message, parts in zip(chat, texts):
                if message["role"] != "tool":
                    message["content"] = [{"type": "text", "text": t} for t in parts]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
    except Exception as e:  # no template, or the template refuses these messages (jinja raise)
        raise ApiError(f"chat template failed: {e}", param="messages") from e
    return text


def template_variables(body: dict, default_kwargs: dict | None = None, effort: bool = True) -> dict:
    """A chat request's template variables, merged as vLLM merges them (merge_kwargs):
    the server's defaults (--default-chat-template-kwargs); over them, key by key, the
    request's reasoning_effort as vLLM reads it (the variable, and enable_thinking, false for
    "none", which templates such as Qwen3's read; `effort` False: a tokenizer that takes no
    variables); over that its chat_template_kwargs. A template that reads none of them
    renders as without."""
    kw = field(body, "chat_template_kwargs", (dict,), {})
    given = body.get("reasoning_effort")
    from_effort = {} if not effort or given is None else {"reasoning_effort": given, "enable_thinking": given != "none"}
    return merge_kwargs(default_kwargs, from_effort | kw)


def thinking_enabled(body: dict, default_kwargs: dict | None = None) -> bool:
    """Whether a chat request leaves the model's thinking on: its template variable
    enable_thinking as template_variables merges it (the server's default, reasoning_effort
    "none", the request's chat_template_kwargs), as parse_messages renders it; read by the
    qwen3 reasoning parser."""
    return template_variables(body, default_kwargs).get("enable_thinking") is not False


# The content parts that are text, and the key each keeps it under (vLLM's parser's); a
# plain string in the list is text too.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}


def text_part(part: Any, i: int) -> str:
    """One of messages[i]'s content parts as text. Media parts are a 400: the models served
    here read text only (vLLM's answer for a text-only model too)."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str):
        raise ApiError(f"messages[{i}]: a content part is a string or an object with a string 'type'",
                       param="messages")
    if kind not in TEXT_PARTS:
        raise ApiError(f"messages[{i}]: content parts of type {kind[:40]!r} are not supported: this model reads "
                       f"text only ({', '.join(TEXT_PARTS)})", param="messages")
    text = part.get(TEXT_PARTS[kind])
    if not isinstance(text, str):
        raise ApiError(f"messages[{i}]: a {kind!r} part needs '{TEXT_PARTS[kind]}': a string", param="messages")
    return text


def _template_call(call: dict, i: int) -> dict:
    """An assistant message's tool call as chat templates take it (transformers' convention,
    as vLLM hands them over): its arguments an object, where OpenAI sends a JSON string; a
    template writing `arguments | tojson` would otherwise show the model an escaped string.
    The call has OpenAI's shape (vLLM's 400 otherwise): {"id": ..., "type": "function",
    "function": {"name": ..., "arguments": ...}}, its arguments a JSON string or already an
    object (the template's own form), id and type optional. Arguments that are no JSON
    object (none, "", JSON null, 42, a list, text that is not JSON: a model's own broken
    call sent back) reach the template as {}, vLLM's rule, so that the conversation goes on."""
    fn = call.get("function")
    where = f"messages[{i}].tool_calls"
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError(f"{where}: each call needs 'function': {{'name': a non-empty string, 'arguments': ...}}",
                       param="messages")
    arguments = fn.get("arguments")
    if arguments is not None and not isinstance(arguments, (str, dict)):
        raise ApiError(f"{where}: function.arguments must be a JSON string (or an object), got "
                       f"{JSON_TYPE.get(type(arguments), 'a ' + type(arguments).__name__)}", param="messages")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise ApiError(f"{where}: a call's 'id' must be a string", param="messages")
    if call.get("type") not in (None, "function"):
        raise ApiError(f"{where}: a call's 'type' must be 'function'", param="messages")
    if isinstance(arguments, dict):
        return call
    try:  # a JSON string: read_body saw neither its depth nor the lone surrogates its escapes decode to
        arguments = loads_checked(arguments or "{}", f"messages[{i}].tool_calls: function.arguments", "messages")
    except ApiError as e:
        if not isinstance(e.__cause__, json.JSONDecodeError):  # (too deep, or a lone surrogate: still a 400)
            raise
        arguments = {}
    return call | {"function": fn | {"arguments": arguments if isinstance(arguments, dict) else {}}}
