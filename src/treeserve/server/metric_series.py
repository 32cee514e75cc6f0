"""Metric series as plain numbers, written by one thread and formatted by a scrape, and the family
(HELP, TYPE, labelled series) that holds them; the text is prometheus_client's exposition, byte for byte."""
from __future__ import annotations

import os
import time
from bisect import bisect_left

from prometheus_client.utils import floatToGoString

# prometheus_client's switch for the `_created` series, honoured the same way
CREATED_SERIES = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _line_start(name: str, labels: dict[str, str]) -> str:
    """`name{labels} ` as the text format writes it (labels sorted by name), value to follow."""
    text = ",".join(f'{key}="{_escape(str(value))}"' for key, value in sorted(labels.items()))
    return f"{name}{{{text}}} " if text else f"{name} "


class Gauge:
    def __init__(self, name: str, labels: dict[str, str]):
        self.value = 0.0
        self._start = _line_start(name, labels)

    def set(self, value: float) -> None:
        self.value = value

    def render(self, out: list[str]) -> None:
        out.append(f"{self._start}{floatToGoString(self.value)}\n")


class Counter(Gauge):
    def __init__(self, name: str, labels: dict[str, str]):
        super().__init__(f"{name}_total", labels)
        self.created_line = f"{_line_start(f'{name}_created', labels)}{floatToGoString(time.time())}\n"

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up: inc({amount})")
        self.value += amount


class Histogram:
    """Bucket counts kept per bucket (cumulated when rendered); the sum is added before the bucket's
    count so that a render never shows a count whose observation is missing from the sum."""

    def __init__(self, name: str, labels: dict[str, str], buckets: tuple[float, ...]):
        self.upper_bounds = [float(b) for b in buckets] + [float("inf")]
        self.counts = [0] * len(self.upper_bounds)
        self.sum = 0.0
        self._bucket_starts = [_line_start(f"{name}_bucket", {**labels, "le": floatToGoString(b)})
                               for b in self.upper_bounds]
        self._count_start = _line_start(f"{name}_count", labels)
        self._sum_start = _line_start(f"{name}_sum", labels)
        self.created_line = f"{_line_start(f'{name}_created', labels)}{floatToGoString(time.time())}\n"
        self._text = ("", -1)  # the last render and its number of observations

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (as that many calls)."""
        self.sum += value * count
        self.counts[bisect_left(self.upper_bounds, value)] += count

    def render(self, out: list[str]) -> None:
        counts = list(self.counts)  # one copy: the engine thread may observe meanwhile
        total = sum(counts)
        if self._text[1] != total:  # no new observation: the same text (counts only grow)
            lines, running = [], 0
            for start, count in zip(self._bucket_starts, counts):
                running += count
                lines.append(f"{start}{floatToGoString(running)}\n")
            lines.append(f"{self._count_start}{floatToGoString(total)}\n")
            lines.append(f"{self._sum_start}{floatToGoString(self.sum)}\n")
            self._text = ("".join(lines), total)
        out.append(self._text[0])


class MirroredHistogram(Histogram):
    """Another histogram's observations under a second name (a deprecated alias vLLM still serves):
    its counts list is the source's own, its sum read from the source, so each value is observed once."""

    def __init__(self, name: str, labels: dict[str, str], source: Histogram):
        self._source = source
        super().__init__(name, labels, tuple(source.upper_bounds[:-1]))
        self.counts = source.counts

    @property
    def sum(self) -> float:
        return self._source.sum

    @sum.setter
    def sum(self, value: float) -> None:  # (Histogram.__init__'s 0.0; nothing observes a mirror)
        pass

    def observe(self, value: float, count: int = 1) -> None:
        raise TypeError("a mirrored histogram is observed through its source")


class Family:
    """One metric's HELP and TYPE and its labelled series, in the order they were made; counters and
    histograms are followed by their `_created` stamps, as prometheus_client writes them."""

    def __init__(self, kind: str, name: str, doc: str, buckets: tuple[float, ...] = (), created: bool = True):
        self.kind, self.name, self.buckets = kind, f"treeserve:{name}", buckets
        self.series: dict[tuple, Gauge | Counter | Histogram] = {}
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        shown = f"{self.name}_total" if kind == "counter" else self.name
        self._header = f"# HELP {shown} {doc}\n# TYPE {shown} {kind}\n"
        self._created_header = (f"# HELP {self.name}_created {doc}\n# TYPE {self.name}_created gauge\n"
                                if created and CREATED_SERIES and kind != "gauge" else None)

    def labels(self, **labels: str):
        key = tuple(sorted(labels.items()))
        series = self.series.get(key)
        if series is None:  # (a new finish reason: on the engine thread; a render iterates over a copy)
            if self.kind == "histogram":
                series = Histogram(self.name, labels, self.buckets)
            else:
                series = (Counter if self.kind == "counter" else Gauge)(self.name, labels)
            self.series[key] = series
        return series

    def mirror(self, source: Histogram, **labels: str) -> MirroredHistogram:
        """A series of this family showing `source`'s observations."""
        series = self.series[tuple(sorted(labels.items()))] = MirroredHistogram(self.name, labels, source)
        return series

    def render(self, out: list[str]) -> None:
        series = list(self.series.values())
        out.append(self._header)
        for one in series:
            one.render(out)
        if self._created_header is not None and series:
            out.append(self._created_header)
            out.extend(one.created_line for one in series)
