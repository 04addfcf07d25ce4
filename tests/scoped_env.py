"""Setting environment variables for the length of a `with` block (engine settings read when a group is set up)."""
import contextlib
import os


class scoped_env:
    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def engine_switch(option, value, **env):
    """An engine option (csrc/host/cpu/engine_options.h, by name) or another `_C._set_*` setter that returns the value
    it replaces, set to `value` for the length of a `with` block under the environment `env` (restored after)."""
    if isinstance(option, str):
        from torch_gemm_ar import _C

        def setter(v):
            return _C._set_engine_option(option, v)
    else:
        setter = option
    previous = setter(value)
    try:
        with scoped_env(**env):
            yield
    finally:
        setter(previous)
