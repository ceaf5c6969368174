"""Makes torch 1.13's sharded-tensor and DCP modules importable on Python
3.11+, where they fail as shipped: a dataclass field of
torch/distributed/_shard/sharded_tensor/metadata.py is declared with a
mutable default (`field(default=TensorProperties())`), which Python 3.11
refuses. enable() installs an import hook that loads that one module from
its source with the field declared as `default_factory=TensorProperties`
(what torch 2.0 does); the installed file is not touched. A no-op where the
module imports as it is."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

_MODULE = "torch.distributed._shard.sharded_tensor.metadata"
_BAD = "field(default=TensorProperties())"
_GOOD = "field(default_factory=TensorProperties)"


class _Loader(importlib.abc.SourceLoader):
    def __init__(self, path):
        self.path = path

    def get_filename(self, fullname):
        return self.path

    def get_data(self, path):
        with open(path, "rb") as f:
            src = f.read()
        return src.replace(_BAD.encode(), _GOOD.encode())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin:
            return None
        with open(spec.origin) as f:
            if _BAD not in f.read():
                return None
        return importlib.util.spec_from_file_location(fullname, spec.origin,
                                                      loader=_Loader(spec.origin))


def enable():
    if _MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
