"""Scenario YAML → validated ``Scenario`` → ``Case`` list (the sweep), with skipped cases and reasons.

A scenario file::

    name: quickstart
    description: What this study answers, in a sentence.
    defaults: {model: decoder-tiny, batch_size: 4, steps: 5}   # any case field
    sweep:                          # any case field may be a list; the sweep is the product
      world_size: [1, 2, 4]
      strategy: [ddp, zero1, zero2, zero3]
      model_args.n_layers: [2, 4]   # a model argument as an axis
    cases:                          # extra cases, each a partial case on top of defaults
      - {strategy: hsdp, world_size: 4, shard_size: 2}
    exclude:                        # drop combinations matching every key (a list matches any)
      - {strategy: ddp, world_size: 1}

Every error names the file, the field and the allowed values; nothing runs on a bad file.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from fsdpbench.core.case import MAX_TEXT, Accepts, Case, field_accepts, resolve_activation_checkpointing
from fsdpbench.core.readback import ReadBackError, read_bounded
from fsdpbench.core.safe_yaml import MAX_FILE_BYTES, YamlInputError, decode_text, load_yaml

_DEFAULT = Case()

# sanity limits: far beyond any real study, small enough that a typo cannot start a runaway
MAX_CASES = 10_000
MAX_DESCRIPTION = 10_000
PLUGIN_PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a directory name under reports/
# more CPU ranks than this per core are refused unless the run allows oversubscription
CPU_RANKS_PER_CORE = 4
ALLOW_PLUGINS_ENV = "FSDPBENCH_ALLOW_PLUGINS"

# strict: a bool is not an int ('world_size: true'), a string is not a number ('steps: "5"')
Flag = Annotated[bool, Field(strict=True)]
Text = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_TEXT)]
ArgValue = bool | int | float | Annotated[str, Field(max_length=MAX_TEXT)] | None


def accepted_type(hint: Any, accepts: Accepts) -> Any:
    """The pydantic type of what a scenario may give a case field of type ``hint`` (None aside), strict."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(hint)
    if hint is bool and accepts.pattern:  # a flag, or a word that says how it is on
        return Flag | Annotated[str, Field(strict=True, pattern=accepts.pattern)]
    if hint is bool:
        return Flag
    if hint is str and accepts.choices:
        return Literal[accepts.choices]
    if hint in (int, float, str):
        return Annotated[hint, Field(strict=True, **accepts.bounds())]  # type: ignore[call-overload]
    if origin is dict:
        return dict[Text, ArgValue]  # arguments: names to scalars
    if origin is tuple:  # a list in YAML
        item = accepted_type(typing.get_args(hint)[0], accepts.items or Accepts())
        members = [Literal[accepts.choices]] if accepts.choices else []
        members += [list[item]] + ([item] if accepts.one_item else [])  # type: ignore[valid-type]
        return typing.Union[tuple(members)] if len(members) > 1 else members[0]  # noqa: UP007
    raise TypeError(f"no scenario type for a case field of type {hint!r}")


def case_fields_model(case_type: type[Any], validators: dict[str, Any] | None = None) -> type[BaseModel]:
    """The scenario's schema of a case: every field of ``case_type`` (a dataclass of ``case_field``s) that
    a scenario may set, each optional (unset: the default, or the scenario's defaults), checked as its
    ``accepts`` declares; an unknown field is an error. ``validators``: pydantic field validators."""
    hints = typing.get_type_hints(case_type)
    definitions: dict[str, Any] = {}
    for f in dataclasses.fields(case_type):
        accepts = field_accepts(f)
        if accepts is not None:
            definitions[f.name] = (accepted_type(hints[f.name], accepts) | None, None)
    model: type[BaseModel] = create_model(
        "CaseFields",
        __config__=ConfigDict(extra="forbid", frozen=True),
        __doc__="Every field a scenario may set for a case (defaults, sweep values, extra cases).",
        __module__=__name__,
        __validators__=validators or {},
        **definitions,
    )
    return model


def _known_alloc_conf(cls: Any, value: str | None) -> str | None:
    from fsdpbench.predictors.memory_model.allocator import parse_alloc_conf

    if value:
        parse_alloc_conf(value)  # ValueError names the setting
    return value


def _known_activation_checkpointing(cls: Any, value: Any) -> Any:
    if isinstance(value, str):
        resolve_activation_checkpointing(value)  # ValueError names the allowed values
    return value


def _known_model(cls: Any, value: str | None) -> str | None:
    from fsdpbench.models import model_names

    if value is not None and value not in model_names():
        raise ValueError(f"unknown model {value!r}; allowed: {', '.join(model_names())}")
    return value


def _known_strategy(cls: Any, value: str | None) -> str | None:
    from fsdpbench.strategies import strategy_names

    if value is None or value in strategy_names():
        return value
    if ":" in value and not PLUGIN_PATTERN.fullmatch(value):
        raise ValueError(f"plugin strategy {value!r} is not package.module:ClassName (absolute, no '/')")
    if ":" not in value:
        raise ValueError(
            f"unknown strategy {value!r}; allowed: {', '.join(strategy_names())}, or module:Class"
        )
    return value


# the schema of a case's fields in a scenario: derived from Case (fsdpbench/core/case.py declares each field's
# bounds); to a type checker, a pydantic model
if typing.TYPE_CHECKING:
    CaseFields = BaseModel
else:
    CaseFields = case_fields_model(
        Case,
        validators={
            "_known_alloc_conf": field_validator("alloc_conf")(_known_alloc_conf),
            "_known_activation_checkpointing": field_validator("activation_checkpointing", mode="before")(
                _known_activation_checkpointing
            ),
            "_known_model": field_validator("model")(_known_model),
            "_known_strategy": field_validator("strategy")(_known_strategy),
        },
    )

CASE_FIELDS = tuple(CaseFields.model_fields)
_ARG_AXES = ("model_args.", "strategy_args.")


class ScenarioFile(BaseModel):
    """The top level of a scenario YAML."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(strict=True)]
    description: Annotated[str, Field(strict=True, max_length=MAX_DESCRIPTION)] = ""
    defaults: CaseFields = CaseFields()
    sweep: dict[Text, Any] = {}
    cases: list[CaseFields] = []
    exclude: list[dict[Text, Any]] = []
    traced: Flag = False  # also run the traced memory predictor for every case (as `run --traced`)

    @field_validator("name")
    @classmethod
    def _directory_name(cls, value: str) -> str:
        # the run directory is reports/<name>/<timestamp>: a name must not climb out of reports/
        if not NAME_PATTERN.fullmatch(value):
            raise ValueError(
                "not a plain directory name "
                "(letters, digits, '.', '_', '-'; first a letter or digit; at most 100)"
            )
        return value


@dataclass(kw_only=True)
class Skipped:
    case: Case
    reason: str


@dataclass(kw_only=True)
class Scenario:
    """A validated scenario: its name, source text and the expanded cases."""

    name: str
    description: str
    path: Path | None
    text: str
    cases: list[Case] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    traced: bool = False


class ScenarioError(ValueError):
    """A scenario file is malformed; the message names the file and field."""


def load_scenario(
    path: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    allow_plugins: bool | None = None,
    allow_oversubscribe: bool = False,
) -> Scenario:
    """Read, validate and expand a scenario file; raise ScenarioError naming the field on bad input."""
    path = Path(path)
    try:
        text = decode_text(read_bounded(path, MAX_FILE_BYTES, what="scenario file"))
    except ReadBackError as exc:
        raise ScenarioError(str(exc)) from None
    except YamlInputError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    return parse_scenario(
        text,
        source=str(path),
        path=path,
        overrides=overrides,
        allow_plugins=allow_plugins,
        allow_oversubscribe=allow_oversubscribe,
    )


def enable_plugin_imports() -> None:
    """Plugins were allowed: let ``module:Class`` find modules in the current directory too, searched
    after everything installed (so a file there cannot shadow an installed module)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def plugins_allowed(allow_plugins: bool | None = None) -> bool:
    """Whether a scenario may name a ``module:Class`` strategy (importing it runs its code)."""
    if allow_plugins is not None:
        return allow_plugins
    return os.environ.get(ALLOW_PLUGINS_ENV, "") == "1"


PluginPermission = bool | frozenset[str]  # every plugin, none, or these module:Class names only


def plugin_permitted(strategy: str, permission: PluginPermission) -> bool:
    """Whether a case of ``strategy`` may be launched: a built-in always; a plugin (``module:Class``)
    only when every plugin is allowed, or this one by name (one typed on the command line permits that
    one, never another that a file read back names)."""
    if ":" not in strategy:
        return True
    return permission is True or (isinstance(permission, frozenset) and strategy in permission)


def case_from_row(row: Any, *, source: str) -> Case:
    """The case of a results row read back from a file, checked as a scenario's case is (``CaseFields``:
    types, bounds, known names) and against the row's own ``case_id`` (an edited field, e.g.
    ``world_size: 16`` in a 2-rank case's row, gives another id); ScenarioError names the file, the case
    and the field. Nothing is imported: a plugin strategy is only checked to be ``module:Class``."""
    from fsdpbench.core.schema import CASE_ID, case_field_values

    cid = row[CASE_ID] if CASE_ID in row else None
    where = f"{source}: case {_short(cid)}"
    if not isinstance(cid, str) or not cid:
        raise ScenarioError(f"{where}: column {CASE_ID}: not a case id")
    try:
        values = case_field_values(row)
    except ValueError as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    settable = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in values.items()
        if k in CASE_FIELDS and v is not None
    }
    try:
        CaseFields.model_validate(settable)
    except ValidationError as exc:
        raise ScenarioError(_format_validation(where, exc)) from None
    for name, value in values.items():
        if name not in CASE_FIELDS and not (isinstance(value, str) and len(value) <= MAX_TEXT):
            raise ScenarioError(f"{where}: {name}: {_short(value)} is not a name of at most {MAX_TEXT}")
    try:
        case = Case(**values)
        rebuilt = case.case_id
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    if rebuilt != cid:
        raise ScenarioError(
            f"{where}: its columns make the case {rebuilt}, not {cid}: the file was edited "
            "(or written by another fsdpbench version)"
        )
    return case


def parse_scenario(
    text: str,
    *,
    source: str = "<scenario>",
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    allow_plugins: bool | None = None,
    allow_oversubscribe: bool = True,
) -> Scenario:
    """Validate and expand scenario text. Nothing is imported or run: a plugin strategy is refused
    unless allowed (``--allow-plugins`` or FSDPBENCH_ALLOW_PLUGINS=1)."""
    try:
        raw = load_yaml(text)
    except YamlInputError as exc:
        raise ScenarioError(f"{source}: {exc.field + ': ' if exc.field else ''}{exc}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: a scenario is a mapping with at least 'name' and 'sweep'")
    try:
        spec = ScenarioFile.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(_format_validation(source, exc)) from None
    _check_sweep(source, spec)
    # an override of null is the field's default, as null is in a scenario's defaults (model_dump drops it)
    overrides = {key: value for key, value in (overrides or {}).items() if value is not None}
    cases, skipped = expand(
        spec, source=source, overrides=overrides, allow_plugins=plugins_allowed(allow_plugins)
    )
    if not allow_oversubscribe:
        check_oversubscription(cases, source)
    return Scenario(
        name=spec.name,
        description=spec.description,
        path=path,
        text=text,
        cases=cases,
        skipped=skipped,
        traced=spec.traced,
    )


def check_oversubscription(cases: list[Case], source: str) -> None:
    """CPU ranks are processes on this machine: refuse far more of them than it has cores."""
    cores = os.cpu_count() or 1
    limit = CPU_RANKS_PER_CORE * cores
    for case in cases:
        if case.device == "cpu" and case.world_size > limit:
            raise ScenarioError(
                f"{source}: world_size: {case.world_size} CPU ranks on {cores} cores (limit {limit}, "
                f"{CPU_RANKS_PER_CORE} per core); pass --allow-oversubscribe to run it anyway"
            )


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")


def in_section(name: str) -> str:
    """What an error about the case field ``name`` ends with: the section of the case it belongs to
    (``model_args.NAME`` is of model_args'); "" for a name that is no case field."""
    field_name = name.partition(".")[0]
    return f" [{Case.section_of(field_name).value} section]" if field_name in CASE_FIELDS else ""


def _section_of_loc(loc: tuple[Any, ...]) -> str:
    """The section note of a validation error's location: the first case field in it, after
    ``defaults``, ``sweep`` or ``cases[i]``."""
    if not loc or loc[0] not in ("defaults", "cases", "sweep"):
        return ""
    names = [p for p in loc[1:] if isinstance(p, str)]
    return in_section(names[0]) if names else ""


def _format_validation(source: str, exc: ValidationError) -> str:
    # an unknown field explains a missing one ('nmae:' → name missing): report it first
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    err = errors[0]
    loc = _loc(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent = err["loc"][0] if len(err["loc"]) > 1 else None
        allowed = (
            CASE_FIELDS if parent in ("defaults", "cases", "sweep") else tuple(ScenarioFile.model_fields)
        )
        close = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1)
        msg = (
            f"unknown field{f' (did you mean {close[0]!r}?)' if close else ''}; allowed: {', '.join(allowed)}"
        )
    else:
        if "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], (dict, list)):
            msg += f" (got {_short(err['input'])})"
        msg += _section_of_loc(err["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {loc}: {msg}{more}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_sweep(source: str, spec: ScenarioFile) -> None:
    """Each sweep value is validated as the case field it sets; errors name sweep.FIELD[i]."""
    for key, value in spec.sweep.items():
        if key not in CASE_FIELDS and not key.startswith(_ARG_AXES):
            raise ScenarioError(
                f"{source}: sweep.{key}: unknown field; allowed: {', '.join(CASE_FIELDS)}, "
                "or model_args.NAME / strategy_args.NAME"
            )
        values = _axis_values(key, value)
        if not values:
            raise ScenarioError(f"{source}: sweep.{key}: empty list; give at least one value")
        if key.startswith(_ARG_AXES):
            for i, item in enumerate(values):
                try:
                    CaseFields.model_validate({key.partition(".")[0]: {key.partition(".")[2]: item}})
                except ValidationError as exc:
                    msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
                    raise ScenarioError(
                        f"{source}: sweep.{key}[{i}]: {msg} (got {_short(item)}){in_section(key)}"
                    ) from None
            continue
        for i, item in enumerate(values):
            try:
                CaseFields.model_validate({key: item})
            except ValidationError as exc:
                msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
                raise ScenarioError(
                    f"{source}: sweep.{key}[{i}]: {msg} (got {_short(item)}){in_section(key)}"
                ) from None
    for i, rule in enumerate(spec.exclude):
        bad = [k for k in rule if k not in CASE_FIELDS and not k.startswith(_ARG_AXES)]
        if bad:
            raise ScenarioError(
                f"{source}: exclude[{i}].{bad[0]}: unknown field; allowed: {', '.join(CASE_FIELDS)}"
            )
    if not spec.sweep and not spec.cases:
        raise ScenarioError(
            f"{source}: sweep: empty; give at least one axis (e.g. strategy: [ddp, zero3]) or 'cases'"
        )
    n_points = math.prod(len(_axis_values(k, v)) for k, v in spec.sweep.items()) + len(spec.cases)
    if n_points > MAX_CASES:
        raise ScenarioError(f"{source}: sweep: expands to {n_points:,} cases; the limit is {MAX_CASES:,}")


def _axis_values(key: str, value: Any) -> list[Any]:
    """A sweep entry as a list of values (a scalar is one value; list-valued fields need a list of lists)."""
    if key == "wrap_classes":
        return value if isinstance(value, list) and value and isinstance(value[0], list) else [value]
    return value if isinstance(value, list) else [value]


def _axes(spec: ScenarioFile) -> dict[str, list[Any]]:
    return {key: _axis_values(key, value) for key, value in spec.sweep.items()}


def _combine(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in point.items():
        if key.startswith(_ARG_AXES):
            group, _, arg = key.partition(".")
            out[group] = {**out.get(group, {}), arg: value}
        else:
            out[key] = value
    return out


def _field_of(fields: dict[str, Any], key: str) -> Any:
    """The value a rule's ``key`` names in a case's fields (``model_args.n_layers`` inside its group)."""
    if key.startswith(_ARG_AXES):
        group, _, arg = key.partition(".")
        return fields.get(group, {}).get(arg)
    return fields.get(key)


def _frozen(value: Any) -> Any:
    """A value as a hashable one, equal where the value is (lists → tuples, dicts → their items)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return frozenset((k, _frozen(v)) for k, v in value.items())
    return value


# exclude rules are matched through a set per combination of keys: a point costs one look-up per
# combination, not one comparison per rule. A rule whose lists multiply past this stays a rule.
_MAX_RULE_COMBINATIONS = 1_000
# look-ups and comparisons of an expansion (10,000 points × 100 key combinations): beyond, a file that
# would take minutes to expand is refused in one line
MAX_EXCLUDE_CHECKS = 1_000_000


class _Exclusion:
    """A scenario's ``exclude`` rules, indexed: ``matches(fields)`` is whether any rule drops a point
    (every key of the rule equal to one of its values; a list of values matches any of them)."""

    def __init__(self, rules: list[dict[str, Any]]) -> None:
        self.sets: dict[tuple[str, ...], set[Any]] = {}
        self.rules: list[dict[str, Any]] = []  # rules whose value lists multiply too far to index
        for rule in rules:
            keys = tuple(sorted(rule))
            options = [rule[k] if isinstance(rule[k], list) else [rule[k]] for k in keys]
            if math.prod(len(o) for o in options) > _MAX_RULE_COMBINATIONS:
                self.rules.append(rule)
                continue
            combos = self.sets.setdefault(keys, set())
            combos.update(_frozen(combo) for combo in itertools.product(*options))

    @property
    def checks_per_point(self) -> int:
        return len(self.sets) + len(self.rules)

    def matches(self, fields: dict[str, Any]) -> bool:
        for keys, combos in self.sets.items():
            if _frozen(tuple(_field_of(fields, k) for k in keys)) in combos:
                return True
        return any(_matches(rule, fields) for rule in self.rules)


def _matches(rule: dict[str, Any], fields: dict[str, Any]) -> bool:
    for key, want in rule.items():
        options = want if isinstance(want, list) else [want]
        if _field_of(fields, key) not in options:
            return False
    return True


def expand(
    spec: ScenarioFile, *, source: str, overrides: dict[str, Any], allow_plugins: bool = False
) -> tuple[list[Case], list[Skipped]]:
    """The sweep's product plus extra cases, checked; impossible ones are Skipped with their reason."""
    base = _combine(spec.defaults.model_dump(exclude_none=True), {})
    axes = _axes(spec)
    n_points = (math.prod(len(v) for v in axes.values()) if axes else 0) + len(spec.cases)
    exclusion = _Exclusion(spec.exclude)
    if n_points * exclusion.checks_per_point > MAX_EXCLUDE_CHECKS:
        raise ScenarioError(
            f"{source}: exclude: {len(spec.exclude):,} rules ({exclusion.checks_per_point:,} sets of keys) "
            f"× {n_points:,} sweep points is more than {MAX_EXCLUDE_CHECKS:,} checks; give fewer rules "
            "(a list of values in one rule matches any of them)"
        )
    points = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] if axes else []
    points += [c.model_dump(exclude_none=True) for c in spec.cases]
    cases: list[Case] = []
    skipped: list[Skipped] = []
    seen: dict[str, Case] = {}
    for point in points:
        fields = _combine(_combine(base, point), overrides)
        fields.setdefault("scenario", spec.name)
        fields["scenario"] = spec.name
        if exclusion.matches(fields):
            continue
        case, reason = build_case(fields, source=source, allow_plugins=allow_plugins)
        if reason:
            skipped.append(Skipped(case=case, reason=reason))
            continue
        if case.case_id in seen:
            continue  # the same case reached twice (e.g. a wrap axis on DDP, which has no wrap)
        seen[case.case_id] = case
        cases.append(case)
    return cases, skipped


def build_case(
    fields: dict[str, Any], *, source: str = "<scenario>", allow_plugins: bool = True
) -> tuple[Case, str | None]:
    """A normalised Case from merged fields, and why it cannot run (or None)."""
    from fsdpbench.models import check_model_args
    from fsdpbench.strategies import get_strategy

    fields = dict(fields)
    # one value in the scenario, two fields of the case; a policy without checkpointing is no policy
    on, policy = resolve_activation_checkpointing(fields.get("activation_checkpointing", False))
    if on and not isinstance(fields.get("activation_checkpointing"), str):
        policy = resolve_activation_checkpointing(fields.get("activation_checkpointing_policy", policy))[1]
    fields["activation_checkpointing"], fields["activation_checkpointing_policy"] = on, policy
    if "wrap_classes" in fields:
        fields["wrap_classes"] = tuple(fields["wrap_classes"])
    name = fields.get("strategy", _DEFAULT.strategy)
    if ":" in name and not allow_plugins:
        raise ScenarioError(
            f"{source}: strategy: {name!r} is a plugin; loading it imports and runs that module's code. "
            f"Allow it with --allow-plugins (or {ALLOW_PLUGINS_ENV}=1)"
        )
    if fields.get("emulate"):
        from fsdpbench.engine.emulate import resolve_emulate_ranks

        fields["emulate_ranks"] = resolve_emulate_ranks(
            fields.get("emulate_ranks", [0]), fields.get("world_size", _DEFAULT.world_size)
        )
    else:  # only an emulated case runs a subset of its ranks; a real one keeps its id
        fields.pop("emulate_ranks", None)
    try:
        strategy = get_strategy(name)
    except KeyError as exc:
        raise ScenarioError(f"{source}: strategy: {exc.args[0]}{in_section('strategy')}") from None
    problem = check_model_args(fields.get("model", _DEFAULT.model), fields.get("model_args") or {})
    if problem:
        raise ScenarioError(f"{source}: model_args: {problem}{in_section('model_args')}")
    device, backend = resolve_backend(fields.get("device", "auto"), fields.get("backend", "auto"))
    fields["device"], fields["backend"] = device, backend
    case = Case(**{k: v for k, v in fields.items() if k in {f.name for f in dataclasses.fields(Case)}})
    # axes a strategy does not use are normalised so equal cases get equal ids
    if not strategy.uses_wrap:
        case = case.replace(wrap="none", wrap_min_params=_DEFAULT.wrap_min_params, wrap_classes=())
    if strategy.sharding.group != "shard_group":
        case = case.replace(shard_size=None)
    from fsdpbench.engine.emulate import check_emulation
    from fsdpbench.engine.knobs import check_knobs, normalize_knobs

    case = normalize_knobs(case, strategy)
    from fsdpbench.predictors.checkpoint import check_checkpoint

    reason = (
        strategy.check(case)
        or check_knobs(case, strategy)
        or check_emulation(case)
        or check_devices(case)
        or check_checkpoint(case, strategy)
    )
    return case, reason


def resolve_backend(device: str, backend: str) -> tuple[str, str]:
    """'auto' picks CUDA+NCCL where usable, else CPU+gloo."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


def check_devices(case: Case) -> str | None:
    """Why this machine cannot run the case's ranks on its device, or None: the one place where a case
    is skipped for lack of GPUs. It looks at the device, not the backend: a `cuda` case needs one GPU per
    rank whatever its backend (two ranks cannot share a GPU: NCCL refuses a duplicate GPU, and any rank
    past the last GPU dies with "invalid device ordinal"). An emulated case runs one rank at a time on one
    device (fake process group), so it needs one GPU: ``Case.devices_needed`` says so."""
    if case.device == "cuda":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if case.devices_needed > have:  # an emulated case needs one GPU, whatever its world size
            if case.emulate:
                return f"needs 1 GPU (emulated rank, device cuda), {have} visible"
            gpus = f"{case.world_size} GPU{'s' if case.world_size != 1 else ''}"
            # the README's quickstart on a 1-GPU machine skips 9 of its 13 cases: say what runs them here
            hint = "; run --emulate measures its ranks one at a time on one GPU here" if have else ""
            return f"needs {gpus} (one per rank, device cuda), {have} visible{hint}"
    if case.backend == "nccl" and case.device != "cuda":
        return "backend nccl needs device cuda"
    return None
