"""`--config FILE`: flags from a YAML file, as vLLM's `vllm serve --config`.

The file is a mapping of flag names (`max-model-len: 1024`, or `max_model_len`) to
values. Each entry becomes the command-line words it stands for, placed before the real
command line, so the parser checks a file's values exactly as it checks typed flags (a
wrong type is the same error naming the flag), and a flag typed on the command line wins
over the file's. A key that is no flag, a value of the wrong shape (a list for a
one-value flag, true for a flag that takes a value, a mapping for a flag that takes no
JSON) or of no JSON type (a YAML date, a binary, a set) are errors naming the file and key.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import yaml


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """parser.parse_args(argv), with the flags of `--config FILE` (if given) read first and
    vLLM's dotted keys of JSON flags (dotted_words) read. Exits through parser.error on a
    bad file, as on any bad flag."""
    argv = dotted_words(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    try:
        words = file_words(parser, args.config)
    except ValueError as e:
        parser.error(str(e))
    return parser.parse_args([*words, *argv])


def dotted_words(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """argv with vLLM's dotted form of a JSON flag read (its FlexibleArgumentParser):
    `--speculative-config.method ngram` (or `=ngram`) is the key method of the flag's
    object, `--x.a.b V` nests, `--x.k+ a,b` is a list of strings that later ones extend. A
    value is JSON where it parses, else the string. A flag's dotted words make one object,
    given after the other words, so it stands in for a whole JSON value given before them."""
    json_flags = {s for a in parser._actions if a.type in (json_text, json_object) for s in a.option_strings}
    words: list[str] = []
    objects: dict[str, dict[str, Any]] = {}
    rest = iter(argv)
    for word in rest:
        name, eq, value = word.partition("=")
        flag, _, path = name.partition(".")
        if not path or flag not in json_flags:
            words.append(word)
            continue
        if not eq:
            value = next(rest, None)
            if value is None:
                parser.error(f"argument {name}: expected one argument")
        keys = path.removesuffix("+").split(".")
        if not all(keys):
            parser.error(f"argument {name}: a dotted key names each level, e.g. {flag}.key value")
        item: Any = value.split(",") if path.endswith("+") else _json_or_text(value)
        for key in reversed(keys[1:]):
            item = {key: item}
        _merge(objects.setdefault(flag, {}), keys[0], item)
    for flag, obj in objects.items():
        words += [flag, json.dumps(obj)]
    return words


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _merge(obj: dict[str, Any], key: str, value: Any) -> None:
    """obj[key] = value, but objects merge and lists extend (vLLM's recursive_dict_update)."""
    old = obj.get(key)
    if isinstance(value, dict) and isinstance(old, dict):
        for k, v in value.items():
            _merge(old, k, v)
    elif isinstance(value, list) and isinstance(old, list):
        old += value
    else:
        obj[key] = value


class OneFile(argparse.Action):
    """--config's action: one file, as vLLM's parser takes (its "More than one config file
    specified!"); a second would silently stand in for the first."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} is given more than once: give one file (its flags, then the command "
                         "line's over them)")
        setattr(namespace, self.dest, values)


class _Loader(yaml.SafeLoader):
    """yaml.safe_load's loader, but an integer past Python's digit limit for int(text) is a
    YAML error with its line, not a ValueError about sys.set_int_max_str_digits."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of more than {sys.get_int_max_str_digits()} digits", node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def file_words(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line words the YAML file at `path` stands for."""
    try:
        with open(path) as f:
            data = yaml.load(f, _Loader)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path}: not UTF-8 text ({e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({_yaml_problem(e)})") from None
    except RecursionError:  # PyYAML's scanner and composer recurse once per level of nesting
        raise ValueError(f"--config {path}: nested too deeply") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of flag names to values, got {type(data).__name__}")
    actions = {s: a for a in parser._actions for s in a.option_strings}
    words: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if not isinstance(key, str) or action is None or flag in ("--config", "--help"):
            raise ValueError(f"--config {path}: {key!r} is not a flag this command takes")
        where = f"--config {path}: {key}"
        if value is None:  # null: the flag's default
            continue
        if action.nargs == 0:  # a switch: store_true or --x/--no-x
            if not isinstance(value, bool):
                raise ValueError(f"{where} is a switch: give true or false, got {value!r}")
            if value:
                words.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):  # false: the other spelling
                positive = "--no-" + flag[2:] in action.option_strings  # flag is --x, not its --no-x
                words.append("--no-" + flag[2:] if positive else "--" + flag.removeprefix("--no-"))
            continue
        if isinstance(value, bool):
            raise ValueError(f"{where} takes a value, not {str(value).lower()}")
        if isinstance(value, list) and action.type is not json_list:
            if action.nargs not in ("+", "*") or not value:
                raise ValueError(f"{where} takes one value, got a list {value!r}")
            items = [_word(where, v, action) for v in value]
            if len(items) == 1:  # as below: a "-k1" is the flag's value
                words.append(f"{flag}={items[0]}")
            elif any(w.startswith("-") for w in items):  # argparse would take it for a flag
                raise ValueError(f"{where}: a list of several values cannot hold one starting with '-' "
                                 f"(got {value!r}); give it alone, or on the command line as {flag}=VALUE")
            else:
                words += [flag, *items]
        else:  # one word: "-k1" (an API key, a name) is the flag's value, not another flag
            words.append(f"{flag}={_word(where, value, action)}")
    return words


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line (its own spans several: a line per mark, naming the file
    again): what it expected, what it found, and where."""
    mark = getattr(e, "problem_mark", None)
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    text = ": ".join(p for p in parts if p) or " ".join(str(e).split())
    return text + (f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "")


def json_value(text: str, name: str) -> Any:
    """A config field's JSON text (--speculative-config, --override-generation-config) parsed,
    or a ValueError naming the field."""
    try:
        return json.loads(text)
    except RecursionError:  # nested past the decoder's stack
        raise ValueError(f"{name} is nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None


def json_text(text: str) -> str:
    """The argparse type of a flag whose value is JSON text (--speculative-config): a
    file may write its value as a YAML mapping."""
    return text


def json_object(text: str) -> dict:
    """The argparse type of a flag whose value is a JSON object (vLLM's
    --default-chat-template-kwargs '{"enable_thinking": false}'): a file may write it as a
    YAML mapping."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text[:100]!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{{\"enable_thinking\": false}}', "
                                         f"got {text[:100]!r}")
    return value


def json_list(text: str) -> list[str]:
    """The argparse type of a flag whose value is a JSON list of strings (vLLM's
    --allowed-origins '["*"]'): a file may write it as a YAML list."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # (nested past the decoder's stack: no list of strings either)
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text[:100]!r}")
    return value


def _word(where: str, value: object, action: argparse.Action) -> str:
    if isinstance(value, list) and action.type is json_list:
        _check_json(where, value)
        return json.dumps(value)
    if isinstance(value, dict):
        if action.type not in (json_text, json_object):
            raise ValueError(f"{where} takes one value, got a mapping {value!r}")
        _check_json(where, value)
        return json.dumps(value)
    if isinstance(value, (list, bool)) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: {value!r} is not a value a flag takes")
    return str(value)


# The most values a flag's JSON may hold: YAML aliases (*name) repeat a node without copying
# it, so ten lines can stand for 9^10 values, which checking and json.dumps would take
# minutes and gigabytes to spell out.
MAX_JSON_VALUES = 10_000


def _check_json(where: str, value: object, budget: list[int] | None = None, flag: str = "") -> None:
    """ValueError naming the place of the first part of `value` JSON cannot hold as YAML
    read it: a non-string key, a date, a binary, a set, a non-finite number; or naming
    the flag when it holds over MAX_JSON_VALUES values."""
    budget, flag = [MAX_JSON_VALUES] if budget is None else budget, flag or where
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"{flag}: more than {MAX_JSON_VALUES:,} values (YAML aliases repeating a node count each "
                         "time)")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string")
            _check_json(f"{where}.{k}", v, budget, flag)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(f"{where}[{i}]", v, budget, flag)
    elif value is not None and not isinstance(value, (str, int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{where}: {value!r} is not a JSON value")
