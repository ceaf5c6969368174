"""Nested state dicts <-> flat keys.

A state dict is a tree of dicts (str or int keys), lists and tuples, whose
leaves are tensors (saved as tensors), ferry.Shard / torch sharded tensors
(saved as shards of a global tensor), objects with state_dict() and
load_state_dict() (an nn.Module, an optimizer: their state dict is saved in
their place) and small JSON values (int, float, str, bool, None, lists and
dicts of them: kept in the manifest's metadata).

Flat keys join the path with "." ("model.layer0.weight",
"optim.state.layer0.weight.exp_avg"). A torch optimizer's state is keyed by
parameter name, not by torch's integer ids, when every parameter it holds
belongs to a module of the same state dict (named_parameters()): two pipeline
stages then never both save "optim.state.0", and a load maps the names back
to the ids of the optimizer it fills.
The path itself is kept too (a list per key, ints as ints, list positions as
[i]) so a state dict can be rebuilt with its original key types.
"""

import json

TREE_META_KEY = "ferry.python.tree"
LEAVES_META_KEY = "ferry.python.leaves"

# A JSON leaf larger than this is refused: the manifest is read whole on
# every load, and big values belong in tensors.
MAX_LEAF_JSON_BYTES = 1 << 20


def _is_tensor(v):
    import torch

    return isinstance(v, torch.Tensor) and type(v).__name__ != "DTensor"


def is_tensor_like(v):
    from ._core import Shard

    if isinstance(v, Shard) or _is_tensor(v):
        return True
    name = type(v).__name__
    return name in ("ShardedTensor", "DTensor")


def is_stateful(v):
    return (
        not is_tensor_like(v)
        and not isinstance(v, (dict, list, tuple))
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


def _has_tensor(v):
    if is_tensor_like(v) or is_stateful(v):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def _component_str(c):
    return str(c[0]) if isinstance(c, list) else str(c)


def join(path):
    return ".".join(_component_str(c) for c in path)


class Flat:
    """One walk of a state dict.

    tensors:   flat key -> tensor-like value
    leaves:    flat key -> JSON value
    paths:     flat key -> path (list of components)
    slots:     flat key -> (container, key or index) holding the value, so a
               load can put a restored leaf back in its place
    stateful:  flat key prefix -> (object, its state dict)
    """

    def __init__(self):
        self.tensors = {}
        self.leaves = {}
        self.paths = {}
        self.slots = {}
        self.stateful = {}
        self.param_names = {}  # id(parameter) -> name, from the modules in the tree

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
    _collect_param_names(state_dict, flat.param_names)
    _walk(state_dict, [], flat, None)
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


def _walk(v, path, flat, slot):
    if is_tensor_like(v):
        if not path:
            raise TypeError("ferry: a state dict must be a dict")
        flat._add(path, "tensor", v, slot)
        return
    if is_stateful(v):
        sd = optim_state_by_name(v, flat.param_names) if is_optimizer(v) else v.state_dict()
        flat.stateful[join(path)] = (v, sd, list(path))
        _walk(sd, path, flat, None)
        return
    if isinstance(v, dict) and (v or not path):
        for k, x in v.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(
                    "ferry: key %r under %r is a %s; keys must be str or int"
                    % (k, join(path), type(k).__name__)
                )
            if isinstance(k, str) and "." in k and not path:
                pass  # "layer.weight" style keys of module state dicts are fine
            _walk(x, path + [k], flat, (v, k))
        return
    if isinstance(v, (list, tuple)) and _has_tensor(v):
        for i, x in enumerate(v):
            _walk(x, path + [[i]], flat, (v, i))
        return
    # A JSON leaf.
    try:
        text = json.dumps(v, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(
            "ferry: value at %r (a %s) is neither a tensor nor JSON-serializable: %s"
            % (join(path), type(v).__name__, e)
        ) from None
    if len(text) > MAX_LEAF_JSON_BYTES:
        raise ValueError(
            "ferry: value at %r is %d bytes as JSON (limit %d): store it as a tensor"
            % (join(path), len(text), MAX_LEAF_JSON_BYTES)
        )
    flat._add(path, "leaf", v, slot)


def encode_meta(flat):
    """The metadata pairs that let a load restore leaves and rebuild the tree."""
    return [
        (TREE_META_KEY, json.dumps(flat.paths, allow_nan=True)),
        (LEAVES_META_KEY, json.dumps(flat.leaves, allow_nan=True)),
    ]


def decode_meta(metadata):
    paths = json.loads(metadata[TREE_META_KEY]) if TREE_META_KEY in metadata else {}
    leaves = json.loads(metadata[LEAVES_META_KEY]) if LEAVES_META_KEY in metadata else {}
    return paths, leaves


def _bad_path(key, path, why):
    from ._lib import FerryError

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
