"""Progress bars for long work: ``progress=True`` shows one at once, ``False`` never, and the default ``None`` only
once the work has run ``DELAY_S`` seconds, so a short call prints nothing and a million-token prefill or a long
decode says how far it is without being asked (tqdm's ``delay``)."""

from __future__ import annotations

try:  # notebook progress bars need ipywidgets; without it tqdm.auto warns at import: plain text bars then
    import ipywidgets  # noqa: F401
    from tqdm.auto import tqdm
except ImportError:
    from tqdm import tqdm

DELAY_S = 2.0


def check(progress) -> None:
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None (a bar once the work lasts {DELAY_S:g} s), "
                        f"got {progress!r}")


def bar(iterable=None, *, progress: bool | None, **kwargs) -> tqdm:
    """A tqdm bar over ``iterable`` (or a manual one) shown as ``progress`` asks; ``kwargs`` go to tqdm."""
    check(progress)
    disable = kwargs.pop("disable", False) or progress is False
    return tqdm(iterable, disable=disable, delay=0 if progress else DELAY_S, **kwargs)
