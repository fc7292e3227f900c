"""Row formats of the MLA KV cache: one row per token per layer.

A row holds the 512-d compressed latent and the 64-d rope key. Each format stores
its row as separate *planes* so that every plane's byte width is a power of two
(Pallas's Triton lowering only handles power-of-two array sizes, and a packed
656 B row is not one):

    {"latent": [..., 512], "scale": [..., G], "rope": [..., 64]}

("scale" is absent for formats without one).

| format    | latent             | scale            | rope       | bytes/row |
|-----------|--------------------|------------------|------------|-----------|
| f32       | float32[512]       | -                | float32[64]| 2304      |
| bf16      | bfloat16[512]      | -                | bf16[64]   | 1152      |
| q8g64     | int8[512]          | bf16[8] (1/64)   | bf16[64]   | 656       |
| fp8g128   | float8_e4m3fn[512] | f32[4] (1/128)   | bf16[64]   | 656       |

Dequantisation is ``q.astype(f32) * scale.astype(f32)`` followed by a cast to the
requested dtype. The Pallas gather kernel (``kernels_pallas.gather_rows``) repeats
exactly this arithmetic so kernel and reference are bit-identical.

Scales never go below a per-format floor (``KVFormat.min_scale``) chosen so that
every non-zero dequantised product ``q * scale`` is a *normal* float32: XLA:CPU
flushes subnormals to zero and GPUs may or may not, so staying normal keeps all
backends bit-identical. An all-zero group therefore gets ``scale = min_scale``
(any positive scale reproduces zeros exactly).

Planes are *stored* as their bits: a plane whose values are a float narrower than
32 bits (bf16, e4m3fn) is an unsigned-integer array of the same width
(``stored_dtype``), which ``pack`` fills and every reader bitcasts back
(``from_stored``) before its arithmetic. XLA:CPU has no arithmetic below float32
and rewrites any op on such an array, a one-row update included, as convert to f32,
op, convert back over the *whole* array, so a bf16 plane cost every decode step a
pass over the whole cache (the tiny model in bf16: 50.7 ms a step with one session
slot, 2.5 s with 64; 4.2 and 5.0 ms stored as bits:
experiments/results/probes/cpu_narrow_cache_steps_8e5255c.txt). Integer arrays it
updates in place, and on GPUs the bitcast is free
(in the Pallas kernels a register reinterpretation). The value dtypes of the table
stay what the format means; saves hold the values (``glm53.engine``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LATENT_DIM = 512
ROPE_DIM = 64

# Smallest normal float32; subnormal inputs may be flushed to zero by FTZ
# backends (XLA:CPU does), costing at most this much absolute error.
_F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """Static description of one KV row format (hashable, usable as a jit static)."""

    name: str
    latent_dtype: np.dtype
    scale_dtype: np.dtype | None  # None: no scale plane.
    scales_per_row: int  # 0 if no scale plane.
    rope_dtype: np.dtype
    # Largest |q| representable in the latent dtype (quantised formats only).
    qmax: float = 0.0
    # Scale floor keeping every non-zero q * scale a normal float32 (see module doc).
    min_scale: float = 0.0

    @property
    def group_size(self) -> int:
        return LATENT_DIM // self.scales_per_row if self.scales_per_row else LATENT_DIM

    @property
    def quantised(self) -> bool:
        return self.scale_dtype is not None

    @property
    def bytes_per_row(self) -> int:
        n = LATENT_DIM * np.dtype(self.latent_dtype).itemsize
        n += ROPE_DIM * np.dtype(self.rope_dtype).itemsize
        if self.scale_dtype is not None:
            n += self.scales_per_row * np.dtype(self.scale_dtype).itemsize
        return n

    @property
    def value_dtypes(self) -> dict[str, np.dtype]:
        """What each plane's elements mean: ``{plane: dtype}`` (the table above)."""
        dtypes = {"latent": np.dtype(self.latent_dtype)}
        if self.scale_dtype is not None:
            dtypes["scale"] = np.dtype(self.scale_dtype)
        dtypes["rope"] = np.dtype(self.rope_dtype)
        return dtypes

    def plane_shapes(self, *lead: int, values: bool = False) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shapes and dtypes of the planes holding ``lead`` rows (e.g. lead = (S, N)): the dtypes they are stored in
        (``stored_dtype``), or with ``values`` the dtypes their elements mean."""
        widths = {"latent": LATENT_DIM, "scale": self.scales_per_row, "rope": ROPE_DIM}
        return {n: ((*lead, widths[n]), dt if values else stored_dtype(dt)) for n, dt in self.value_dtypes.items()}


KV_FORMATS: dict[str, KVFormat] = {
    "f32": KVFormat("f32", np.dtype(jnp.float32), None, 0, np.dtype(jnp.float32)),
    "bf16": KVFormat("bf16", np.dtype(jnp.bfloat16), None, 0, np.dtype(jnp.bfloat16)),
    "q8g64": KVFormat(
        "q8g64",
        np.dtype(jnp.int8),
        np.dtype(jnp.bfloat16),
        8,
        np.dtype(jnp.bfloat16),
        qmax=127.0,
        # |q| >= 1 for non-zero q, so q * scale >= 2**-126.
        min_scale=2.0**-126,
    ),
    "fp8g128": KVFormat(
        "fp8g128",
        np.dtype(jnp.float8_e4m3fn),
        np.dtype(jnp.float32),
        4,
        np.dtype(jnp.bfloat16),
        qmax=448.0,
        # The smallest non-zero e4m3fn magnitude is 2**-9, so q * scale >= 2**-126.
        min_scale=2.0**-117,
    ),
}


def stored_dtype(dtype) -> np.dtype:
    """The dtype an array of ``dtype`` values is stored in: a float narrower than 32 bits as the unsigned integer of
    its width (its bits unchanged; module doc), any other dtype as itself."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def to_stored(x: jax.Array) -> jax.Array:
    """``x``'s bits in ``stored_dtype(x.dtype)`` (unchanged if that is its dtype)."""
    dt = stored_dtype(x.dtype)
    return x if dt == x.dtype else jax.lax.bitcast_convert_type(x, dt)


def from_stored(x: jax.Array, dtype) -> jax.Array:
    """The ``dtype`` values whose bits ``x`` stores (``to_stored``'s inverse; in Pallas kernels too)."""
    dtype = np.dtype(dtype)
    if x.dtype != stored_dtype(dtype):
        raise ValueError(f"{x.dtype} does not store {dtype} values (their stored dtype is {stored_dtype(dtype)})")
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def get_format(fmt: str | KVFormat) -> KVFormat:
    """Returns the format named ``fmt`` (a KVFormat passes through)."""
    if isinstance(fmt, KVFormat):
        return fmt
    try:
        return KV_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"Unknown KV format {fmt!r}; valid formats: {sorted(KV_FORMATS)}") from None


def _group_amax(latent: jax.Array, fmt: KVFormat) -> jax.Array:
    """f32[..., G]: max |x| per group of ``fmt.group_size`` latent values."""
    x = latent.astype(jnp.float32)
    g = x.reshape(*x.shape[:-1], fmt.scales_per_row, fmt.group_size)
    return jnp.max(jnp.abs(g), axis=-1)


def _ceil_to_bf16(x: jax.Array) -> jax.Array:
    """Smallest bf16 >= x, for finite x >= 0 (bit trick: bf16 is the top half of f32)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)


def _next_up_bf16(b: jax.Array) -> jax.Array:
    """Next bf16 above b, for finite b > 0."""
    bits = jax.lax.bitcast_convert_type(b, jnp.uint16) + jnp.uint16(1)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def compute_scales(fmt: KVFormat, latent: jax.Array) -> jax.Array:
    """Per-group scales ``[..., G]`` in ``fmt.scale_dtype`` (quantised formats only).

    q8g64: ``scale = ceil_bf16(amax / 127)``, bumped one bf16 ulp more if the f32
    quotient ``amax / scale`` still exceeds 127, so ``|fl(x / scale)| <= 127`` for
    every x in the group and the clip in ``pack`` never changes a value.
    fp8g128: ``scale = fl(amax / 448)`` in f32. ``fl(x / scale)`` can exceed 448 by
    one f32 ulp, which rounds back to 448 in e4m3fn (the next value up would be 480).
    Both are floored at ``fmt.min_scale`` (covers amax == 0; see module doc).
    """
    fmt = get_format(fmt)
    if not fmt.quantised:
        raise ValueError(f"KV format {fmt.name!r} has no scale plane")
    amax = _group_amax(latent, fmt)
    if fmt.name == "q8g64":
        scale = _ceil_to_bf16(amax / jnp.float32(fmt.qmax))
        too_small = amax / scale.astype(jnp.float32) > jnp.float32(fmt.qmax)
        scale = jnp.where(too_small, _next_up_bf16(scale), scale)
    else:
        scale = amax / jnp.float32(fmt.qmax)
    floor = jnp.asarray(fmt.min_scale, fmt.scale_dtype)
    return jnp.maximum(scale.astype(fmt.scale_dtype), floor)


def pack(fmt: str | KVFormat, latent: jax.Array, rope: jax.Array) -> dict[str, jax.Array]:
    """Encodes rows ``latent[..., 512]``, ``rope[..., 64]`` (any leading dims) into planes, as stored
    (``stored_dtype``)."""
    return {n: to_stored(v) for n, v in _encode(get_format(fmt), latent, rope).items()}


def _encode(fmt: KVFormat, latent: jax.Array, rope: jax.Array) -> dict[str, jax.Array]:
    """The planes' values (``KVFormat.value_dtypes``)."""
    if latent.shape[-1] != LATENT_DIM or rope.shape[-1] != ROPE_DIM:
        raise ValueError(
            f"pack expects latent[..., {LATENT_DIM}] and rope[..., {ROPE_DIM}], got " f"{latent.shape} and {rope.shape}"
        )
    planes = {"rope": rope.astype(fmt.rope_dtype)}
    if not fmt.quantised:
        planes["latent"] = latent.astype(fmt.latent_dtype)
        return planes
    scale = compute_scales(fmt, latent)
    x = latent.astype(jnp.float32).reshape(*latent.shape[:-1], fmt.scales_per_row, fmt.group_size)
    y = x / scale.astype(jnp.float32)[..., None]
    if fmt.name == "q8g64":
        # jnp.round is round-half-to-even.
        q = jnp.clip(jnp.round(y), -fmt.qmax, fmt.qmax).astype(jnp.int8)
    else:
        q = y.astype(jnp.float8_e4m3fn)
    planes["latent"] = q.reshape(latent.shape)
    planes["scale"] = scale
    return planes


def dequantise_latent(fmt: KVFormat, q: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """``q.astype(f32) * scale.astype(f32)`` per group, cast to ``dtype``; ``q`` and ``scale`` as stored.

    This is the arithmetic the Pallas gather kernel repeats group by group.
    """
    q = from_stored(q, fmt.latent_dtype)
    if not fmt.quantised:
        return q.astype(dtype)
    qf = q.astype(jnp.float32).reshape(*q.shape[:-1], fmt.scales_per_row, fmt.group_size)
    x = qf * from_stored(scale, fmt.scale_dtype).astype(jnp.float32)[..., None]
    return x.reshape(q.shape).astype(dtype)


def unpack(fmt: str | KVFormat, planes: dict[str, jax.Array], dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Decodes planes (as stored) back to ``(latent[..., 512], rope[..., 64])`` in ``dtype``."""
    fmt = get_format(fmt)
    latent = dequantise_latent(fmt, planes["latent"], planes.get("scale"), dtype)
    return latent, from_stored(planes["rope"], fmt.rope_dtype).astype(dtype)


def error_bound(fmt: str | KVFormat, latent: jax.Array) -> jax.Array:
    """Worst-case |unpack(pack(x)) - x| per latent element, unpacking to float32.

    Notation: s is the group's scale, fl() is float32 rounding (relative error
    <= 2**-24), t = 2**-126 is the smallest normal f32. Every bound adds t to cover
    backends that flush subnormal inputs to zero (XLA:CPU does).

    * f32: exact, 0 (+ t).
    * bf16: round-to-nearest-even with 8 significand bits: 2**-8 * |x| (+ t).
    * q8g64: y = fl(x / s) = (x / s)(1 + d), |d| <= 2**-24, and |y| <= 127 by the
      choice of s, so the clip is inactive. q = round(y): |q - y| <= 1/2. The product
      q * s is exact in f32 (7-bit integer times 8-bit significand). Hence
      |q s - x| <= s |q - y| + s |y - x / s| <= s (1/2 + 127 * 2**-24).
    * fp8g128: y = fl(x / s) as above with |y| <= 448 (+1 ulp, which rounds back
      to 448). e4m3fn has 4 significand bits and normals down to 2**-6: rounding y
      costs |q - y| <= max(2**-4 |y|, 2**-10) (relative half-ulp for normals, half
      the subnormal spacing 2**-9 below). Dequantising rounds once more in f32:
      fl(q s) = q s (1 + e), |e| <= 2**-24. Summing, with |y| <= |x| / s (1 + 2**-24)
      and |q| <= |y| (1 + 2**-4) + 2**-10:
        |fl(q s) - x| <= s |q - y| + s |y - x / s| + |q| s 2**-24
                      <= max(2**-4 |x|, 2**-10 s) + 2**-21 (|x| + s).
    Unpacking to bf16 adds bf16 rounding of the result: 2**-8 of its magnitude.
    """
    fmt = get_format(fmt)
    x = jnp.abs(latent.astype(jnp.float32))
    tiny = jnp.float32(_F32_TINY)
    if fmt.name == "f32":
        return jnp.zeros_like(x) + tiny
    if fmt.name == "bf16":
        return x * jnp.float32(2.0**-8) + tiny
    s = compute_scales(fmt, latent).astype(jnp.float32)
    s = jnp.repeat(s, fmt.group_size, axis=-1)
    if fmt.name == "q8g64":
        return s * jnp.float32(0.5 + fmt.qmax * 2.0**-24) + tiny
    if fmt.name == "fp8g128":
        return jnp.maximum(x * jnp.float32(2.0**-4), s * jnp.float32(2.0**-10)) + jnp.float32(2.0**-21) * (x + s) + tiny
    raise ValueError(f"no error bound derived for format {fmt.name!r}")


def rope_error_bound(fmt: str | KVFormat, rope: jax.Array) -> jax.Array:
    """Worst-case |unpack(pack(r)) - r| per rope element (float32 unpack).

    Rope is stored unquantised: exact for f32, bf16 rounding (2**-8 relative) otherwise.
    """
    fmt = get_format(fmt)
    r = jnp.abs(rope.astype(jnp.float32))
    tiny = jnp.float32(_F32_TINY)
    if np.dtype(fmt.rope_dtype) == np.dtype(jnp.float32):
        return jnp.zeros_like(r) + tiny
    return r * jnp.float32(2.0**-8) + tiny
