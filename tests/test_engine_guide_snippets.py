"""docs/engine-guide.md cannot drift from the code: every ```python block compiles, and every kvcore name it uses exists.

The checker reads the guide's Python blocks in order, as one adapter would be
written, and follows what it can know statically:

* ``import kvcore...`` / ``from kvcore... import name``: the module imports and
  has the name;
* ``kvcore.X.Y`` and ``Name.attr`` for a name imported from kvcore: the
  attribute exists;
* a transceiver (a variable or attribute named ``tx`` or ``transceiver``, or
  anything assigned ``Transceiver(...)``): every attribute used on it exists
  on :class:`kvcore.transceiver.Transceiver`;
* values returned by kvcore calls (``tx.poll()`` gives a ``PollResult``,
  ``tx.start_send()`` a ``TransferParams``...) and the items of lists they
  hold (``for o in r.done``: an ``Outcome``), from the real type hints: every
  attribute used on them exists;
* every call to something kvcore: its keyword arguments are parameters of the
  real signature, and it is not given more positional arguments than it takes.

Names the checker cannot type (engine objects: vLLM's ``request``, SGLang's
``req``) are not checked. Engine facts are not checked here: only that the
kvcore side of each sketch is real.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

import kvcore
from kvcore.transceiver import Transceiver

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "engine-guide.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)
TX_NAMES = frozenset({"tx", "transceiver"})


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, source) of every ```python block of a Markdown file, in order."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


@dataclasses.dataclass(frozen=True)
class Obj:
    """A real object a name refers to: a kvcore module, class, function or method."""

    value: Any
    instance_method: bool = False  # a function looked up on a class for an instance: its ``self`` is bound


@dataclasses.dataclass(frozen=True)
class Inst:
    """An instance of a kvcore class (``Transceiver``, ``PollResult``...)."""

    cls: type


@dataclasses.dataclass(frozen=True)
class ListOf:
    """A list whose items are instances of a kvcore class (``PollResult.done``)."""

    cls: type


Ref = Obj | Inst | ListOf


def _is_kvcore(obj: Any) -> bool:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "") or ""
    return name == "kvcore" or name.startswith("kvcore.")


def _fields(cls: type) -> set[str]:
    out = set(getattr(cls, "__dataclass_fields__", {}))
    out |= set(getattr(cls, "__struct_fields__", ()))
    return out


def has_member(obj: Any, name: str) -> bool:
    """True when ``obj.name`` exists: an attribute, a dataclass field or a msgspec field."""
    if hasattr(obj, name):
        return True
    return isinstance(obj, type) and name in _fields(obj)


def _hint_ref(hint: Any) -> Ref | None:
    """The Ref of a type hint when it names a kvcore class (``X``, ``X | None``, ``list[X]``)."""
    origin = typing.get_origin(hint)
    if origin in (list, tuple) or (origin is not None and getattr(origin, "__name__", "") in ("Sequence", "Iterable")):
        args = [a for a in typing.get_args(hint) if isinstance(a, type) and _is_kvcore(a)]
        return ListOf(args[0]) if args else None
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            ref = _hint_ref(arg)
            if ref is not None:
                return ref
        return None
    if isinstance(hint, type) and _is_kvcore(hint):
        return Inst(hint)
    return None


def _kvcore_names() -> dict[str, Any]:
    """The classes of every loaded kvcore module, for hints imported only under TYPE_CHECKING (``-> TransferAgent``)."""
    names: dict[str, Any] = {}
    for mod_name, module in list(sys.modules.items()):
        if module is not None and (mod_name == "kvcore" or mod_name.startswith("kvcore.")):
            names.update({k: v for k, v in vars(module).items() if isinstance(v, type) and _is_kvcore(v)})
    return names


def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except NameError:
        try:
            return typing.get_type_hints(obj, localns=_kvcore_names())
        except Exception:  # a hint that does not resolve at run time: that name stays untyped
            return {}
    except Exception:
        return {}


def member_ref(owner: Ref, name: str) -> Ref | None:
    """What ``owner.name`` refers to, as far as it is known."""
    if isinstance(owner, Obj):
        value = getattr(owner.value, name, None)
        return Obj(value) if value is not None else None
    if isinstance(owner, Inst):
        attr = inspect.getattr_static(owner.cls, name, None)
        if isinstance(attr, property) and attr.fget is not None:
            return _hint_ref(_hints(attr.fget).get("return"))
        if callable(attr) or isinstance(attr, (classmethod, staticmethod)):
            return Obj(getattr(owner.cls, name), instance_method=inspect.isfunction(attr))
        return _hint_ref(_hints(owner.cls).get(name))
    return None


def call_result(func: Ref) -> Ref | None:
    """What calling ``func`` returns: an instance for a kvcore class, else the return hint's kvcore class."""
    if not isinstance(func, Obj):
        return None
    if isinstance(func.value, type) and _is_kvcore(func.value):
        return Inst(func.value)
    if callable(func.value):
        return _hint_ref(_hints(func.value).get("return"))
    return None


class Checker(ast.NodeVisitor):
    """Walks snippets in order, keeping what each name refers to, and records every use of a missing kvcore name."""

    def __init__(self) -> None:
        self.env: dict[str, Ref] = {}
        self.errors: list[str] = []
        self.checked = 0  # kvcore names and calls verified (so a test can tell the checker saw something)
        self.where = ""

    def check(self, source: str, where: str) -> None:
        self.where = where
        self.visit(ast.parse(source))

    def _error(self, node: ast.AST, msg: str) -> None:
        self.errors.append(f"{self.where} line {getattr(node, 'lineno', '?')}: {msg}")

    @staticmethod
    def _key(node: ast.AST) -> str | None:
        """``x`` or ``self.x``: the names the environment keeps."""
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return f"self.{node.attr}"
        return None

    def ref(self, node: ast.AST) -> Ref | None:
        """What an expression refers to (None: not known to be kvcore)."""
        key = self._key(node)
        if key is not None and key in self.env:
            return self.env[key]
        if isinstance(node, ast.Name) and node.id in TX_NAMES:
            return Inst(Transceiver)
        if isinstance(node, ast.Attribute):
            if node.attr in TX_NAMES:  # self.tx, self.mgr.tx: a transceiver by the guide's convention
                return Inst(Transceiver)
            owner = self.ref(node.value)
            return None if owner is None else member_ref(owner, node.attr)
        if isinstance(node, ast.Call):
            func = self.ref(node.func)
            return None if func is None else call_result(func)
        return None

    # --- imports and bindings -----------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "kvcore":
                continue
            try:
                module = importlib.import_module(alias.name)
            except ImportError as exc:
                self._error(node, f"import {alias.name}: {exc}")
                continue
            self.checked += 1
            if alias.asname:
                self.env[alias.asname] = Obj(module)
            else:
                self.env["kvcore"] = Obj(kvcore)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.module or node.module.split(".")[0] != "kvcore" or node.level:
            return
        try:
            module = importlib.import_module(node.module)
        except ImportError as exc:
            self._error(node, f"from {node.module} import ...: {exc}")
            return
        for alias in node.names:
            self.checked += 1
            if not has_member(module, alias.name):
                self._error(node, f"{node.module} has no name {alias.name!r}")
                continue
            self.env[alias.asname or alias.name] = Obj(getattr(module, alias.name))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        value = self.ref(node.value)
        for target in node.targets:
            key = self._key(target)
            if key is None:
                continue
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        key = self._key(node.target)
        if key is not None and node.value is not None:
            value = self.ref(node.value)
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        seq = self.ref(node.iter)
        key = self._key(node.target)
        if key is not None:
            if isinstance(seq, ListOf):
                self.env[key] = Inst(seq.cls)
            else:
                self.env.pop(key, None)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    def _bind_params(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # A function's parameters shadow whatever those names meant before.
        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            if arg.arg not in TX_NAMES:
                self.env.pop(arg.arg, None)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._bind_params(node)
        self.generic_visit(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._bind_params(node)
        self.generic_visit(node)

    # --- uses -----------------------------------------------------------------------------------

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        if isinstance(node.ctx, ast.Store):
            return
        owner = self.ref(node.value)
        if owner is None:
            return
        if isinstance(owner, ListOf):
            return
        if isinstance(owner, Obj) and not (
            isinstance(owner.value, (types.ModuleType, type)) and _is_kvcore(owner.value)
        ):
            return  # a method or function: its own attributes are not the API
        target = owner.value if isinstance(owner, Obj) else owner.cls
        self.checked += 1
        if not has_member(target, node.attr):
            name = getattr(target, "__name__", repr(target))
            self._error(node, f"{ast.unparse(node)}: {name} has no attribute {node.attr!r}")

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = self.ref(node.func)
        if not isinstance(func, Obj) or not callable(func.value):
            return
        target = func.value
        if not (_is_kvcore(target) or _is_kvcore(getattr(target, "__func__", target))):
            return
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError):
            return
        self.checked += 1
        params = list(sig.parameters.values())[1 if func.instance_method else 0 :]
        names_ok = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        for kw in node.keywords:
            if kw.arg is not None and not names_ok and kw.arg not in named:
                self._error(node, f"{ast.unparse(node.func)}() has no parameter {kw.arg!r} (it takes {sorted(named)})")
        if not any(p.kind is p.VAR_POSITIONAL for p in params) and not any(
            isinstance(a, ast.Starred) for a in node.args
        ):
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(node.args) > len(positional):
                self._error(
                    node,
                    f"{ast.unparse(node.func)}() takes {len(positional)} positional arguments, given {len(node.args)}",
                )


def check_guide(path: Path = GUIDE) -> Checker:
    checker = Checker()
    for line, source in python_blocks(path):
        try:
            compile(source, f"{path.name}:{line}", "exec")
        except SyntaxError as exc:
            checker.errors.append(f"{path.name} block at line {line}: does not compile: {exc}")
            continue
        checker.check(source, f"{path.name} block at line {line}")
    return checker


def check_source(source: str) -> list[str]:
    checker = Checker()
    checker.check(source, "snippet")
    return checker.errors


# --- the guide ------------------------------------------------------------------------------------


def test_guide_has_python_blocks_that_compile() -> None:
    blocks = python_blocks(GUIDE)
    assert len(blocks) >= 7, f"docs/engine-guide.md has only {len(blocks)} python blocks"
    for line, source in blocks:
        compile(source, f"engine-guide.md:{line}", "exec")  # raises SyntaxError naming the block's line


def test_guide_uses_only_real_kvcore_names() -> None:
    checker = check_guide()
    assert not checker.errors, "docs/engine-guide.md uses names the code does not have:\n" + "\n".join(checker.errors)
    assert checker.checked >= 60, f"only {checker.checked} kvcore names were checked: is the checker still typing tx?"


def _section(title_start: str) -> str:
    text = GUIDE.read_text()
    parts = re.split(r"^## +", text, flags=re.M)
    found = [p for p in parts if p.startswith(title_start)]
    assert found, f"docs/engine-guide.md has no '## {title_start}...' section"
    return found[0]


@pytest.mark.parametrize(
    ("section", "engine_calls"),
    [
        (
            "8. vLLM",
            [
                "get_num_new_matched_tokens",
                "update_state_after_alloc",
                "build_connector_meta",
                "request_finished",
                "register_kv_caches",
                "start_load_kv",
                "wait_for_layer_load",
                "save_kv_layer",
                "wait_for_save",
                "get_finished",
                "get_block_ids_with_load_errors",
                "kv_transfer_params",
                "plugins/vllm/README.md",
            ],
        ),
        (
            "9. SGLang",
            [
                "KVManager",
                "KVSender",
                "KVReceiver",
                "init",
                "send",
                "send_metadata",
                "poll",
                "failure_exception",
                "bootstrap",
                "Bootstrapping",
                "WaitingForInput",
                "Transferring",
                "Success",
                "Failed",
            ],
        ),
        (
            "10. TensorRT-LLM",
            [
                "respondAndSendAsync",
                "requestAndReceiveAsync",
                "checkContextTransferStatus",
                "checkGenTransferStatus",
                "cancelRequest",
                "CacheTransceiverConfig",
                "kv_transfer_timeout_ms",
                "opaque_state",
            ],
        ),
    ],
)
def test_each_engine_has_a_mapping_and_a_sketch(section: str, engine_calls: list[str]) -> None:
    text = _section(section)
    assert "```python" in text, f"section {section!r} has no adapter sketch"
    assert re.search(r"^\|.*\|.*\|\s*$", text, re.M), f"section {section!r} has no mapping table"
    missing = [c for c in engine_calls if c not in text]
    assert not missing, f"section {section!r} does not mention {missing}"


def test_guide_covers_the_engine_api() -> None:
    """Every engine-facing call of the transceiver is explained somewhere in the guide."""
    text = GUIDE.read_text()
    api = [
        "start_send",
        "start_receive",
        "expect",
        "layers_ready",
        "set_aux",
        "cancel",
        "poll",
        "poll_local",
        "status",
        "stats",
        "leaks",
        "close",
        "info_endpoint",
    ]
    for name in api:
        assert has_member(Transceiver, name), f"the test names {name!r}, which Transceiver does not have"
        assert f"{name}(" in text or f"`{name}`" in text or f".{name}" in text, f"the guide never mentions {name}"
    for state in kvcore.RequestStatus:
        assert state.value in text, f"the guide does not explain RequestStatus.{state.name}"


# --- the checker itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "complaint"),
    [
        ("tx.start_sendd(1, [2])\n", "start_sendd"),
        ("self.tx.poll_globally()\n", "poll_globally"),
        ("tx.start_send(1, [2], promptlen=3)\n", "promptlen"),
        ("tx.cancel(1, 'why', 'extra')\n", "positional"),
        ("from kvcore.params import derive_tickets\n", "derive_tickets"),
        ("import kvcore\nkvcore.TransferParamz.make(1, 'tcp://h:1')\n", "TransferParamz"),
        ("from kvcore import TransferParams\np = TransferParams.make(1, 'tcp://h:1', tiket=b'x')\n", "tiket"),
        ("from kvcore import TransferParams\np = TransferParams.make(1, 'tcp://h:1')\np.blocks\n", "blocks"),
        ("r = tx.poll()\nfor o in r.done:\n    o.payload\n", "payload"),
        ("r = tx.poll_local()\nr.releasd\n", "releasd"),
        ("p = tx.start_send(1, [2])\np.tickt\n", "tickt"),
        ("from kvcore.transceiver import RequestStatus\nRequestStatus.WAITING_FOR_INPUT\n", "WAITING_FOR_INPUT"),
        ("from kvcore import TransceiverConfig\nTransceiverConfig(lease_seconds=3)\n", "lease_seconds"),
    ],
)
def test_checker_catches_a_wrong_name(source: str, complaint: str) -> None:
    errors = check_source(source)
    assert errors and complaint in errors[0], f"the checker missed {complaint!r} in {source!r}: {errors}"


def test_checker_accepts_the_real_api() -> None:
    source = (
        "from kvcore import TransferParams\n"
        "from kvcore.params import derive_ticket\n"
        "p = tx.start_send('r1', [1, 2], prompt_len=32, mode='pull', aux=b'x')\n"
        "d = p.to_dict()\n"
        "q = TransferParams.from_dict(d)\n"
        "tx.start_receive(params=q, block_ids=[3, 4])\n"
        "r = tx.poll_local()\n"
        "for o in r.done:\n"
        "    print(o.request_id, o.aux, o.state, o.error)\n"
        "for rid in r.released:\n"
        "    pass\n"
        "t = derive_ticket(b'0' * 16, 'r1')\n"
    )
    checker = Checker()
    checker.check(source, "snippet")
    assert not checker.errors and checker.checked >= 12, (checker.errors, checker.checked)


def test_config_fields_the_guide_names_exist() -> None:
    """Every configuration field the guide names in backticks (``lease_s``, ``max_aux_bytes``...) is a real field."""
    from kvcore import TransceiverConfig

    engine_names = {"max_tokens_in_buffer"}  # TensorRT-LLM's CacheTransceiverConfig, named in its mapping table
    text = GUIDE.read_text()
    names = set(re.findall(r"`([a-z][a-z0-9_]*)`", text))
    config_like = {
        n
        for n in names
        if (n.endswith(("_s", "_bytes")) or n.startswith(("max_", "bounce_", "require_")) or n == "transfer_mode")
        and n not in engine_names
    }
    fields = {f.name for f in dataclasses.fields(TransceiverConfig)}
    assert len(config_like) >= 15, sorted(config_like)
    assert config_like <= fields, (
        f"the guide names configuration fields that do not exist: {sorted(config_like - fields)}"
    )


def test_security_doc_describes_tickets_as_built() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    assert "Not yet built" not in text and "is not built yet" not in text
    for name in ("derive_ticket", "require_tickets", "new_ticket", "TicketError", "tickets_refused", "TransferParams"):
        assert name in text, f"docs/security.md does not mention {name}"
    from kvcore import params

    assert hasattr(params, "derive_ticket") and hasattr(params, "new_ticket")
