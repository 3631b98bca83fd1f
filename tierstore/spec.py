"""Table specifications and deterministic initial row values."""
from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from tierstore.precision import DTYPES, round_nearest
from tierstore.validate import check_choice, check_int, check_number, is_int
from tierstore.errors import ArgumentTypeError, SettingError

MAX_ID = (1 << 63) - 1
MAX_NAME = 128
_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{MAX_NAME - 1}}}", re.ASCII)
INIT_KINDS = ("zeros", "uniform", "normal")
_UNBOUNDED_FIELDS = ("admit_after", "admit_width", "admit_depth", "ttl_steps", "evict_l2_below")


@dataclass(frozen=True)
class RowInit:
    """Initial value of a row never written: a pure function of (table, row id, seed).

    ``uniform``: U(a, b); ``normal``: N(a, b) (mean a, std b); ``zeros`` ignores a, b.
    ``col_start``: the table holds columns ``[col_start, col_start + dim)`` of a
    wider row (a column shard, tierstore.distributed), so its initial values are
    that row's slice.
    """

    kind: str = "zeros"
    a: float = 0.0
    b: float = 0.0
    seed: int = 0
    col_start: int = 0

    def __post_init__(self):
        if self.kind not in INIT_KINDS:
            raise SettingError(f"RowInit.kind must be one of {INIT_KINDS}, got {self.kind!r}")
        if self.kind == "uniform" and not self.a < self.b:
            raise SettingError(f"RowInit uniform needs a < b, got a={self.a}, b={self.b}")
        if self.kind == "normal" and not self.b > 0:
            raise SettingError(f"RowInit normal needs std b > 0, got b={self.b}")
        check_int(self.col_start, "RowInit.col_start", meaning="first column of a column shard")

    @classmethod
    def uniform(cls, low: float, high: float, seed: int = 0) -> "RowInit":
        return cls("uniform", float(low), float(high), int(seed))

    @classmethod
    def normal(cls, mean: float = 0.0, std: float = 1.0, seed: int = 0) -> "RowInit":
        return cls("normal", float(mean), float(std), int(seed))


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    ``num_rows=None`` is an unbounded id space: any id in [0, 2**63) is valid and
    rows come into being on first touch. ``state_dim`` extra float32 values per
    row travel with the weights through every tier (optimizer state).
    ``dtype`` "float16" or "bfloat16" stores the weights at half the bytes
    (tierstore.precision); rows are still read and written as float32.

    Unbounded id spaces (docs/admission.md):
    ``admit_after=N`` keeps a trainer's updates of a row only from the N-th step
    that uses it on, counted in a count-min sketch of ``admit_depth`` rows of
    ``admit_width`` saturating 8-bit counters; ``ttl_steps=T`` makes a row unused
    for T steps of its table read as its initial value again, and deletes it from
    disk in the background; ``evict_l2_below=x`` does the same to a row whose
    weights' L2 norm is below x when a step uses it.
    """

    name: str
    num_rows: int | None
    dim: int
    dtype: str = "float32"
    init: RowInit = field(default_factory=RowInit)
    state_dim: int = 0
    admit_after: int = 1
    admit_width: int = 1 << 20
    admit_depth: int = 4
    ttl_steps: int | None = None
    evict_l2_below: float | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            # LMDB names are C strings: "a\0x" and "a\0y" would be one database
            raise SettingError(f"TableSpec.name must be 1 to {MAX_NAME} ASCII letters, digits, '_', '.' or '-', "
                             f"starting with a letter, digit or '_', got {self.name!r}")
        check_int(self.num_rows, "TableSpec.num_rows", at_least=1, at_most=MAX_ID + 1, none=True,
                  meaning="None = an unbounded id space")
        check_int(self.dim, "TableSpec.dim", at_least=1)
        check_choice(self.dtype, "TableSpec.dtype", sorted(DTYPES), "the weights' storage type")
        if not isinstance(self.init, RowInit):
            raise ArgumentTypeError("TableSpec.init must be a tierstore.RowInit (e.g. RowInit.normal(0, 0.01))")
        check_int(self.state_dim, "TableSpec.state_dim", meaning="optimizer state values per row")
        self._check_unbounded_knobs()

    def _check_unbounded_knobs(self) -> None:
        # 255: the sketch's counters are 8-bit and saturate there
        check_int(self.admit_after, "TableSpec.admit_after", at_least=1, at_most=255,
                  meaning="steps a row is used in before its updates are kept; 1 = always")
        if not is_int(self.admit_width) or not 1 <= self.admit_width <= 1 << 30 or self.admit_width & (self.admit_width - 1):
            raise SettingError(f"TableSpec.admit_width must be a power of two in [1, 2**30] (counters per sketch row; "
                             f"about the distinct ids expected, e.g. 1 << 22), got {self.admit_width!r}")
        check_int(self.admit_depth, "TableSpec.admit_depth", at_least=1, at_most=8,
                  meaning="sketch rows, each with its own hash")
        check_int(self.ttl_steps, "TableSpec.ttl_steps", at_least=1, none=True,
                  meaning="steps of the table a row may go unused before it is evicted; None = never")
        check_number(self.evict_l2_below, "TableSpec.evict_l2_below", above=True, none=True,
                     meaning="rows whose weights' L2 norm is below it are evicted when used; keep it below the initial rows' norms")

    @property
    def width(self) -> int:
        """float32 values per row as read and written: weights then state."""
        return self.dim + self.state_dim

    @property
    def lived(self) -> bool:
        """Admission, TTL or the L2 score (docs/admission.md): rows come and go."""
        return self.admit_after > 1 or self.ttl_steps is not None or self.evict_l2_below is not None

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row: weights in ``dtype``, then float32 state."""
        return self.dim * DTYPES[self.dtype].itemsize + 4 * self.state_dim

    def to_json(self) -> dict:
        # fields added later only when set: a store that uses none of them stays readable by older tierstores
        d = dataclasses.asdict(self)
        if not self.init.col_start:
            del d["init"]["col_start"]
        for f in dataclasses.fields(self):
            if f.name in _UNBOUNDED_FIELDS and d[f.name] == f.default:
                del d[f.name]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TableSpec":
        d = dict(d)
        d["init"] = RowInit(**d["init"])
        return cls(**d)


def _splitmix64(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finalizer of uint64 ``x``, into ``out`` when given (``out=x`` is safe):
    in place, a row init's [n, dim] words make no temporaries beyond one shift."""
    x = np.add(x, np.uint64(0x9E3779B97F4A7C15), out=out)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x ^= x >> np.uint64(shift)
        x *= np.uint64(mult)
    x ^= x >> np.uint64(31)
    return x


def _unit_uniform(spec: TableSpec, ids: np.ndarray, stream: int) -> np.ndarray:
    """U[0,1) doubles of shape [len(ids), dim], a pure function of (table, id, column, seed)."""
    salt = (zlib.crc32(spec.name.encode()) << 32) ^ (spec.init.seed & 0xFFFFFFFF) ^ (stream << 62)
    base = _splitmix64(ids.astype(np.uint64) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))
    first = spec.init.col_start
    cols = np.arange(first, first + spec.dim, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
    bits = np.add(base[:, None], cols[None, :])
    bits = _splitmix64(bits, out=bits)
    bits >>= np.uint64(11)
    u = bits.astype(np.float64)
    u *= 1.0 / (1 << 53)
    return u


def initial_rows(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """Stored rows (weights and zero state) of never-written ids, float32 [n, width]."""
    out = np.zeros((len(ids), spec.width), dtype=np.float32)
    if len(ids) == 0 or spec.init.kind == "zeros":
        return out
    a, b = spec.init.a, spec.init.b
    with np.errstate(over="ignore"):
        # in place, in the order of a + b * sqrt(-2 log1p(-u)) * cos(2 pi v) (Box-Muller;
        # 1-u keeps the log argument in (0, 1]) or a + (b - a) * u: the same doubles, so
        # the same rows, without a temporary per operation
        w = _unit_uniform(spec, ids, 0)
        if spec.init.kind == "uniform":
            w *= b - a
        else:
            np.negative(w, out=w)
            np.log1p(w, out=w)
            w *= -2.0
            np.sqrt(w, out=w)
            w *= b
            v = _unit_uniform(spec, ids, 1)
            v *= 2 * np.pi
            np.cos(v, out=v)
            w *= v
        w += a
    out[:, : spec.dim] = w
    if spec.dtype != "float32":
        out[:, : spec.dim] = round_nearest(torch.from_numpy(out[:, : spec.dim]), spec.dtype).numpy()
    return out
