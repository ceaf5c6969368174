"""Nested state dicts <-> flat keys.

A state dict is a tree of dicts (str or int keys), lists and tuples, whose
leaves are tensors (saved as tensors), ferry.Shard / torch sharded tensors
(saved as shards of a global tensor), objects with state_dict() and
load_state_dict() (an nn.Module, an optimizer: their state dict is saved in
their place) and small Python values (kept in the manifest's metadata):
JSON values as JSON; tuples, sets, bytes, dicts with non-str keys, and
containers of them in a typed encoding that keeps their types; anything else
with pickle, marked so that a load runs it only when allowed
(allow_pickle=True).

Flat keys join the path with "." ("model.layer0.weight",
"optim.state.layer0.weight.exp_avg"). A torch optimizer's state is keyed by
parameter name, not by torch's integer ids, when every parameter it holds
belongs to a module of the same state dict (named_parameters()): two pipeline
stages then never both save "optim.state.0", and a load maps the names back
to the ids of the optimizer it fills.
Per-rank values (one per rank, ferry.per_rank): everything under a
ferry.per_rank(value) wrapper; torch.Generator objects; everything under a
key named "rng", "rng_state", "rng_states" or ending in "_rng", "_rng_state",
"_rng_states" (torch.get_rng_state(), torch.cuda.get_rng_state_all(),
random.getstate()); and the state dict of a data loader (an object with
state_dict() whose class is a torch DataLoader or named *DataLoader, as
torchdata's StatefulDataLoader). Each rank's copy is stored under
"<key>@rank<r>": tensors as they are, generators as their get_state(), other
values in the typed encoding below as bytes. Flat.per_rank marks them.
The path itself is kept too (a list per key, ints as ints, list positions as
[i]) so a state dict can be rebuilt with its original key types.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
from typing import Any, Callable, Union

from ._lib import FerryError
from ._shards import Shard

TREE_META_KEY = "ferry.python.tree"
LEAVES_META_KEY = "ferry.python.leaves"  # flat key -> JSON value (values JSON holds as they are)
VALUES_META_KEY = "ferry.python.values"  # flat key -> typed encoding (the others)
PICKLED_META_KEY = "ferry.python.pickled"  # the keys of VALUES whose encoding holds pickle
# flat key -> "tensor" | "value" | "generator": how its per-rank copies decode
PER_RANK_META_KEY = "ferry.python.per_rank"

ON_RESIZE = ("error", "first")


class PerRank:
    """A value each rank holds its own of (ferry.per_rank): see per_rank."""

    __slots__ = ("value", "on_resize")

    def __init__(self, value, on_resize="error"):
        if not callable(on_resize) and on_resize not in ON_RESIZE:
            raise ValueError("ferry.per_rank: on_resize = %r: expected 'error', 'first' or a "
                             "function (saved values, rank, world_size) -> value" % (on_resize,))
        self.value = value
        self.on_resize = on_resize

    # A load puts a restored leaf back through its slot: (wrapper, "value").
    def __getitem__(self, k):
        return self.value

    def __setitem__(self, k, v):
        self.value = v

    def __repr__(self):
        return "ferry.per_rank(%r, on_resize=%r)" % (self.value, self.on_resize)


def per_rank(value: Any, on_resize: Union[str, Callable[..., Any]] = "error") -> PerRank:
    """Marks `value` (a tensor, a torch.Generator, any value a state dict may
    hold, or a subtree of them) as one value per rank: every rank stores its
    own, and a load into the same world size gives each rank its own back
    (in place: tensors and generators are filled, other values are put in
    the wrapper's .value). Into another world size, on_resize decides:
    "error" (the load fails naming the key and both world sizes), "first"
    (every rank gets rank 0's value), or a function f(values, rank,
    world_size) given the list of the saved ranks' values (index = saved
    rank; tensors, decoded values, generators as torch.Generator) that
    returns this rank's value."""
    return PerRank(value, on_resize)


_RNG_SUFFIXES = ("_rng", "_rng_state", "_rng_states")


def rng_name(c):
    if not isinstance(c, str):
        return False
    c = c.lower()
    return c in ("rng", "rng_state", "rng_states") or c.endswith(_RNG_SUFFIXES)


def _is_generator(v):
    if type(v).__name__ != "Generator":
        return False
    import torch

    return isinstance(v, torch.Generator)


def _is_data_loader(v):
    if type(v).__name__.endswith("DataLoader"):
        return True
    import torch

    return isinstance(v, torch.utils.data.DataLoader)


_PER_RANK_KEY = re.compile(r"^(.*)@rank(0|[1-9][0-9]{0,9})$", re.S)


def parse_per_rank_key(key):
    """(entry key, rank) of a checkpoint key "<key>@rank<r>", else None."""
    m = _PER_RANK_KEY.match(key)
    return (m.group(1), int(m.group(2))) if m else None


def per_rank_copies(keys):
    """entry key -> {saved rank: checkpoint key} of the per-rank copies among keys."""
    out = {}
    keys = list(keys)
    if "@rank" not in "\0".join(keys):  # one C-speed scan for the usual checkpoint
        return out
    for k in keys:
        if "@rank" not in k:  # the regex only for the few that may match
            continue
        pr = parse_per_rank_key(k)
        if pr is not None:
            out.setdefault(pr[0], {})[pr[1]] = k
    return out

# A JSON leaf larger than this is refused: the manifest is read whole on
# every load, and big values belong in tensors.
MAX_LEAF_JSON_BYTES = 1 << 20


def _is_tensor(v):
    import torch

    return isinstance(v, torch.Tensor) and type(v).__name__ != "DTensor"


_tensor_like_types = {}  # type -> is_tensor_like: it depends on the type alone
_PLAIN = []


def _plain_tensor_type():
    """torch.Tensor itself (not a subclass: a Parameter, a DTensor)."""
    if not _PLAIN:
        import torch

        _PLAIN.append(torch.Tensor)
    return _PLAIN[0]


def is_tensor_like(v):
    tp = type(v)
    known = _tensor_like_types.get(tp)
    if known is not None:
        return known
    r = isinstance(v, Shard) or _is_tensor(v) or tp.__name__ in ("ShardedTensor", "DTensor")
    _tensor_like_types[tp] = r
    return r


def is_stateful(v):
    return (
        not is_tensor_like(v)
        and not isinstance(v, (dict, list, tuple))
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


def _has_tensor(v):
    if is_tensor_like(v) or is_stateful(v) or type(v) is PerRank:
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def _has_generator(v):
    if _is_generator(v):
        return True
    if isinstance(v, dict):
        return any(_has_generator(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_generator(x) for x in v)
    return False


def _component_str(c):
    return str(c[0]) if isinstance(c, list) else str(c)


def join(path):
    try:
        return ".".join(path)  # all str: the common case, at C speed
    except TypeError:
        return ".".join(_component_str(c) for c in path)


class Flat:
    """One walk of a state dict.

    tensors:   flat key -> tensor-like value
    leaves:    flat key -> JSON value
    paths:     flat key -> path (list of components)
    slots:     flat key -> (container, key or index) holding the value, so a
               load can put a restored leaf back in its place
    stateful:  flat key prefix -> (object, its state dict)
    typed:     flat key -> typed encoding, for leaves JSON cannot hold as they are
    pickled:   the keys of typed whose encoding holds pickle
    per_rank:  flat key -> on_resize policy of the per-rank entries (tensors,
               and leaves: those are in per_rank_bytes or generators)
    per_rank_bytes: flat key -> UTF-8 typed encoding of a per-rank leaf
    generators: flat key -> torch.Generator (a per-rank leaf)
    """

    def __init__(self):
        self.tensors = {}
        self.leaves = {}
        self.paths = {}
        self.slots = {}
        self.stateful = {}
        self.root = None
        self._param_names = None
        self.typed = {}
        self.pickled = set()
        self.per_rank = {}
        self.per_rank_bytes = {}
        self.generators = {}

    @property
    def param_names(self):
        """id(parameter) -> name, from the modules in the tree; walked only
        when an optimizer needs it."""
        if self._param_names is None:
            self._param_names = {}
            _collect_param_names(self.root, self._param_names)
        return self._param_names

    def _add(self, path, kind, value, slot):
        key = join(path)
        if key in self.paths:
            raise ValueError("ferry: two entries flatten to the same key %r" % key)
        self.paths[key] = list(path)
        self.slots[key] = slot
        if kind == "tensor":
            self.tensors[key] = value
        else:
            self.leaves[key] = value


def flatten(state_dict):
    if not isinstance(state_dict, dict):
        raise TypeError("ferry: a state dict must be a dict, got %s" % type(state_dict).__name__)
    flat = Flat()
    flat.root = state_dict
    _walk(state_dict, [], flat, None, None)
    return flat


def _is_module(v):
    import torch

    return isinstance(v, torch.nn.Module)


def is_optimizer(v):
    import torch

    return isinstance(v, torch.optim.Optimizer)


def _collect_param_names(v, out):
    if _is_module(v):
        for name, p in v.named_parameters():
            out.setdefault(id(p), name)
    elif isinstance(v, dict):
        for x in v.values():
            _collect_param_names(x, out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _collect_param_names(x, out)


def _optimizer_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def optim_state_by_name(opt, names):
    """opt.state_dict() with its state and param_groups' params keyed by
    parameter name; torch's own (integer ids) when a parameter has no name
    here or two share one."""
    sd = opt.state_dict()
    params = _optimizer_params(opt)
    named = [names.get(id(p)) for p in params]
    if not params or None in named or len(set(named)) != len(named):
        return sd
    # torch numbers the parameters in param_groups order.
    return {
        "state": {named[i]: s for i, s in sd["state"].items()},
        "param_groups": [dict(g, params=[named[i] for i in g["params"]])
                         for g in sd["param_groups"]],
    }


def is_named_optim_state(sd):
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    return bool(groups) and all(
        isinstance(i, str) for g in groups for i in g.get("params", [])
    )


def optim_state_by_id(sd):
    """An optimizer state saved by parameter name in torch's own form:
    torch numbers parameters in param_groups order, so the saved groups give
    each name its id (what a `{}` placeholder hands the caller)."""
    order = [n for g in sd["param_groups"] for n in g.get("params", [])]
    index = {n: i for i, n in enumerate(order)}
    return {
        "state": {index[n]: s for n, s in sd.get("state", {}).items() if n in index},
        "param_groups": [dict(g, params=[index[n] for n in g.get("params", [])])
                         for g in sd["param_groups"]],
    }


def load_optim_by_name(opt, values, prefix, names):
    """Fills `opt` from checkpoint values (flat key -> value) saved by name
    under `prefix`: each "<prefix>.state.<name>.<field>" goes to the
    parameter of that name here (other names, another stage's, are not this
    optimizer's), hyperparameters from the saved "<prefix>.param_groups".
    False, touching nothing, when the checkpoint keyed it by integer ids."""
    head = prefix + "." if prefix else ""
    saved_groups = values.get(head + "param_groups")
    if not isinstance(saved_groups, list) or not all(
        isinstance(g, dict) and all(isinstance(n, str) for n in g.get("params", []))
        for g in saved_groups
    ):
        return False  # saved by torch's integer ids: the caller loads it as torch does
    params = _optimizer_params(opt)
    index = {names[id(p)]: i for i, p in enumerate(params)}
    longest_first = sorted(index, key=len, reverse=True)
    state = {}
    for ck, v in values.items():
        if ck.startswith(head + "state."):
            rest = ck[len(head) + len("state."):]
            name = next((n for n in longest_first if rest.startswith(n + ".")), None)
            if name is not None:
                state.setdefault(index[name], {})[rest[len(name) + 1:]] = v
    param_groups = []
    for gi, g in enumerate(opt.param_groups):
        saved = saved_groups[gi] if gi < len(saved_groups) else {}
        group = {k: saved.get(k, x) for k, x in g.items() if k != "params"}
        group["params"] = [index[names[id(p)]] for p in g["params"]]
        param_groups.append(group)
    opt.load_state_dict({"state": state, "param_groups": param_groups})
    return True


def _walk(v, path, flat, slot, owner, pr=None):
    """pr: the on_resize policy when v is (under) a per-rank value, else None."""
    if type(v) is PerRank:
        if not path:
            raise TypeError("ferry: a state dict must be a dict, not a ferry.per_rank value")
        _walk(v.value, path, flat, (v, "value"), owner, v.on_resize)
        return
    if pr is None and path and rng_name(path[-1]):
        pr = "error"
    if is_tensor_like(v):
        if not path:
            raise TypeError("ferry: a state dict must be a dict")
        flat._add(path, "tensor", v, slot)
        if pr is not None:
            if not _is_tensor(v):
                raise TypeError("ferry: the per-rank value at %r is a shard (%s); a per-rank "
                                "value is one whole tensor per rank" % (join(path),
                                                                       type(v).__name__))
            flat.per_rank[join(path)] = pr
        return
    if _is_generator(v):
        flat._add(path, "leaf", v, slot)
        key = join(path)
        flat.per_rank[key] = pr or "error"
        flat.generators[key] = v
        return
    if is_stateful(v):
        if pr is None and _is_data_loader(v):
            pr = "error"
        sd = optim_state_by_name(v, flat.param_names) if is_optimizer(v) else v.state_dict()
        flat.stateful[join(path)] = (v, sd, list(path))
        _walk(sd, path, flat, None, v, pr)
        return
    if isinstance(v, dict) and (v or not path):
        plain = _plain_tensor_type()
        for k, x in v.items():
            if type(k) is str:
                # A plain tensor under a name that is no RNG's: what the
                # call below would do, without the call (tens of thousands).
                if type(x) is plain and pr is None and not rng_name(k):
                    flat._add(path + [k], "tensor", x, (v, k))
                    continue
            elif not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(
                    "ferry: key %r under %r is a %s; keys must be str or int"
                    % (k, join(path), type(k).__name__)
                )
            _walk(x, path + [k], flat, (v, k), owner, pr)
        return
    if isinstance(v, (list, tuple)) and (_has_tensor(v) or _has_generator(v)):
        for i, x in enumerate(v):
            _walk(x, path + [[i]], flat, (v, i), owner, pr)
        return
    # A leaf: JSON when JSON gives it back as it is, else the typed encoding.
    key = join(path)
    if pr is not None:
        # Per-rank: stored as bytes in each rank's own copy, never in the
        # manifest's metadata (which keeps rank 0's).
        ctx = _Encoder(key, owner)
        text = json.dumps(ctx.encode(v), allow_nan=True)
        if len(text) > MAX_LEAF_JSON_BYTES:
            raise ValueError("ferry: value at %r is %d bytes encoded (limit %d): store it as a "
                             "tensor" % (key, len(text), MAX_LEAF_JSON_BYTES))
        flat._add(path, "leaf", v, slot)
        flat.per_rank[key] = pr
        flat.per_rank_bytes[key] = text.encode("utf-8")
        return
    enc = None
    if _plain(v):
        text = json.dumps(v, allow_nan=True)
    else:
        ctx = _Encoder(key, owner)
        enc = ctx.encode(v)
        text = json.dumps(enc, allow_nan=True)
    if len(text) > MAX_LEAF_JSON_BYTES:
        raise ValueError(
            "ferry: value at %r is %d bytes encoded (limit %d): store it as a tensor"
            % (key, len(text), MAX_LEAF_JSON_BYTES)
        )
    flat._add(path, "leaf", v, slot)
    if enc is not None:
        flat.typed[key] = enc
        if ctx.pickled:
            flat.pickled.add(key)


_SCALARS = (type(None), bool, int, float, str)


def _plain(v):
    """True when JSON gives v back with the same types (exact types: a
    subclass such as an IntEnum or numpy.float64 is not plain)."""
    t = type(v)
    if t in _SCALARS:
        return True
    if t is list:
        return all(_plain(x) for x in v)
    if t is dict:
        return all(type(k) is str and _plain(x) for k, x in v.items())
    return False


class _OwnerPickler(pickle.Pickler):
    """Pickles the object whose state dict holds the value as a reference, so
    a scheduler's bound method (OneCycleLR.anneal_func) stores its name, not
    the scheduler, its optimizer and their tensors."""

    def __init__(self, f, owner):
        super().__init__(f, protocol=4)
        self._owner = owner

    def persistent_id(self, obj):
        return "owner" if self._owner is not None and obj is self._owner else None


class _OwnerUnpickler(pickle.Unpickler):
    def __init__(self, f, owner, key):
        super().__init__(f)
        self._owner = owner
        self._key = key

    def persistent_load(self, pid):
        if pid == "owner" and self._owner is not None:
            return self._owner
        raise FerryError("the value at %r refers to the object whose state dict held it (%r); "
                         "load it into that object (ferry.load with the object in the state "
                         "dict)" % (self._key, pid), "invalid_argument")


class _Encoder:
    """Typed encoding of one leaf: JSON scalars as they are, containers as
    {"tuple"|"list"|"set"|"frozenset": [...]}, {"dict": [[k, v], ...]},
    {"bytes": base64}, anything else {"pickle": base64, "type": name}."""

    def __init__(self, key, owner):
        self.key = key
        self.owner = owner
        self.pickled = False

    def encode(self, v):
        t = type(v)
        if t in _SCALARS:
            return v
        if t in (list, tuple, set, frozenset):
            return {t.__name__: [self.encode(x) for x in v]}
        if t is dict:
            return {"dict": [[self.encode(k), self.encode(x)] for k, x in v.items()]}
        if t is bytes:
            return {"bytes": base64.b64encode(v).decode("ascii")}
        buf = io.BytesIO()
        try:
            _OwnerPickler(buf, self.owner).dump(v)
        except Exception as e:
            raise TypeError("ferry: value at %r (a %s) is neither a tensor, JSON, nor picklable: %s"
                            % (self.key, t.__name__, e)) from None
        self.pickled = True
        return {"pickle": base64.b64encode(buf.getvalue()).decode("ascii"), "type": _type_name(t)}


def _type_name(t):
    return t.__name__ if t.__module__ == "builtins" else "%s.%s" % (t.__module__, t.__qualname__)


class Pickled:
    """A value of a checkpoint stored with pickle, not yet unpickled (a load
    unpickles it only with allow_pickle=True)."""

    __slots__ = ("data", "type")

    def __init__(self, data, type_name):
        self.data = data
        self.type = type_name

    def __repr__(self):
        return "<ferry.Pickled %s, %d bytes: load with allow_pickle=True>" % (self.type,
                                                                             len(self.data))


def _decode(key, e):
    if type(e) in _SCALARS:
        return e
    if type(e) is dict and len(e) in (1, 2):
        tag = next(iter(e))
        x = e[tag]
        if tag in ("list", "tuple", "set", "frozenset") and type(x) is list and len(e) == 1:
            items = [_decode(key, y) for y in x]
            return items if tag == "list" else {"tuple": tuple, "set": set,
                                                "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(x) is list and len(e) == 1:
            out = {}
            for kv in x:
                if type(kv) is not list or len(kv) != 2:
                    break
                out[_decode(key, kv[0])] = _decode(key, kv[1])
            else:
                return out
        if tag in ("bytes", "pickle") and type(x) is str:
            try:
                raw = base64.b64decode(x.encode("ascii"), validate=True)
            except ValueError:
                raw = None
            if raw is not None and tag == "bytes" and len(e) == 1:
                return raw
            if raw is not None and tag == "pickle" and type(e.get("type")) is str:
                return Pickled(raw, e["type"])
    raise _bad_value(key, e)


def _bad_value(key, e):
    text = json.dumps(e)
    return FerryError("checkpoint value metadata (%s) of key %r: %s is not a value encoding"
                      % (VALUES_META_KEY, key, text[:200]), "corruption")


def pickled_types(v):
    """The type names of the pickled parts of a decoded value."""
    if isinstance(v, Pickled):
        return [v.type]
    if isinstance(v, dict):
        return [t for k, x in v.items() for t in pickled_types(k) + pickled_types(x)]
    if isinstance(v, (list, tuple, set, frozenset)):
        return [t for x in v for t in pickled_types(x)]
    return []


def unpickle(key, v, owner=None):
    """v with its Pickled parts unpickled; `owner` stands for the object
    whose state dict held the value when it was saved."""
    if isinstance(v, Pickled):
        return _OwnerUnpickler(io.BytesIO(v.data), owner, key).load()
    if type(v) is dict:
        return {unpickle(key, k, owner): unpickle(key, x, owner) for k, x in v.items()}
    if type(v) in (list, tuple, set, frozenset):
        return type(v)(unpickle(key, x, owner) for x in v)
    return v


def encode_meta(flat):
    """The metadata pairs that let a load restore leaves and rebuild the tree."""
    plain = {k: v for k, v in flat.leaves.items() if k not in flat.typed and k not in flat.per_rank}
    pairs = [
        (TREE_META_KEY, json.dumps(flat.paths, allow_nan=True)),
        (LEAVES_META_KEY, json.dumps(plain, allow_nan=True)),
    ]
    if flat.typed:
        pairs.append((VALUES_META_KEY, json.dumps(flat.typed, allow_nan=True)))
    if flat.pickled:
        pairs.append((PICKLED_META_KEY, json.dumps(sorted(flat.pickled))))
    if flat.per_rank:
        kinds = {k: "generator" if k in flat.generators else
                 "value" if k in flat.per_rank_bytes else "tensor" for k in flat.per_rank}
        pairs.append((PER_RANK_META_KEY, json.dumps(kinds)))
    return pairs


def decode_per_rank(key, kind, t):
    """One saved rank's value of per-rank entry `key` from its loaded tensor:
    the tensor, a torch.Generator with that state, or the decoded value
    (pickled parts as Pickled)."""
    if kind == "generator":
        import torch

        g = torch.Generator()
        g.set_state(t)
        return g
    if kind == "value":
        try:
            e = json.loads(t.numpy().tobytes().decode("utf-8"))
        except ValueError:
                raise FerryError("checkpoint per-rank value of key %r is not a value encoding"
                             % key, "corruption") from None
        return _decode(key, e)
    return t


def decode_values(metadata):
    """(flat key -> value, keys holding pickle) of the typed leaves: pickled
    parts stay Pickled (nothing of the checkpoint runs here)."""
    if VALUES_META_KEY not in metadata:
        return {}, set()
    raw = json.loads(metadata[VALUES_META_KEY])
    if type(raw) is not dict:
        raise _bad_value(VALUES_META_KEY, raw)
    values = {k: _decode(k, e) for k, e in raw.items()}
    pickled = {k for k, v in values.items() if pickled_types(v)}
    return values, pickled


def decode_paths(metadata):
    return json.loads(metadata[TREE_META_KEY]) if TREE_META_KEY in metadata else {}


def decode_leaves(metadata):
    return json.loads(metadata[LEAVES_META_KEY]) if LEAVES_META_KEY in metadata else {}


def _bad_path(key, path, why):
    return FerryError("checkpoint tree metadata (%s) of key %r: path %r %s"
                      % (TREE_META_KEY, key, path, why), "corruption")


def _check_path(key, path, limit):
    """A saved path as flatten makes it: str or int keys, [i] list positions
    with 0 <= i < limit (every element of a saved list holds at least one of
    the checkpoint's entries, so no position reaches their number), or an
    error naming the key; crafted metadata must not make build() allocate
    by its numbers."""
    if not isinstance(path, list):
        raise _bad_path(key, path, "is not a list")
    for c in path:
        if isinstance(c, list):
            if len(c) != 1 or type(c[0]) is not int or not 0 <= c[0] < limit:
                raise _bad_path(key, path, "has list position %r (expected [i] with 0 <= i < %d)"
                                % (c, limit))
        elif type(c) not in (str, int):
            raise _bad_path(key, path, "has component %r (expected a str or an int)" % (c,))


def build(items, paths, strip=0):
    """A nested dict from flat key -> value, using the saved paths (minus
    their first `strip` components) where known, else the flat key."""
    root = {}
    limit = max(len(items), len(paths))
    for key, value in items.items():
        path = paths.get(key, [key])
        _check_path(key, path, limit)
        path = path[strip:]
        if not path:
            continue
        node = root
        try:
            for c, nxt in zip(path[:-1], path[1:]):
                node = _child(node, c, [] if isinstance(nxt, list) else {})
            _put(node, path[-1], value)
        except (TypeError, AttributeError):
            raise _bad_path(key, path, "clashes with another key's path") from None
    return _lists(root)


def _child(node, c, empty):
    if isinstance(c, list):
        i = c[0]
        while len(node) <= i:
            node.append(None)
        if node[i] is None:
            node[i] = empty
        return node[i]
    if c not in node:
        node[c] = empty
    return node[c]


def _put(node, c, value):
    if isinstance(c, list):
        i = c[0]
        while len(node) <= i:
            node.append(None)
        node[i] = value
    else:
        node[c] = value


def _lists(v):
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_lists(x) for x in v]
    return v
