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
def engine_switch(setter, value, **env):
    """An engine switch set for the length of a `with` block, under the environment `env`: `setter` is one of the
    extension's `_C._set_*` test switches, which return the value they replace (restored after)."""
    previous = setter(value)
    try:
        with scoped_env(**env):
            yield
    finally:
        setter(previous)
