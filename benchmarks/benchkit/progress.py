"""A dependency-free progress bar for long runs (rank 0 only): redrawn in place on a terminal, one line per tenth
of the work in a log file."""
import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None, width: int = 30):
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.monotonic()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_tenth = -1

    def step(self, what: str = ""):
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        filled = int(self.width * self.done / self.total)
        text = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{elapsed:5.0f}s elapsed, ~{eta:.0f}s left  {what}")
        if self.tty:
            self.stream.write("\r" + text[:150].ljust(150))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            tenth = self.done * 10 // self.total
            if tenth == self._last_tenth:
                return
            self._last_tenth = tenth
            self.stream.write(text + "\n")
        self.stream.flush()
