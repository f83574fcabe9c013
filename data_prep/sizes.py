"""What a conversion will hold, checked before it writes (issue 70, item 7).

The patch against the volumes, the output against the disk, a study's arrays against the
memory.

``python -m data_prep.brats ... --patch 998`` once ran silently: 80x80 slices padded into
998x998 patches (a 924 MB ``images.npy`` of zeros), and with ``--dims 3`` it tried to allocate
about 95 GB on a 23 GiB machine, printing nothing. A converter now reads its volumes' sizes
from their headers (no voxel is read) and

* refuses a patch larger than every side of every volume (:func:`patch_problem`: such a patch
  holds the whole volume and pads it on every side) and says what padding a patch larger
  than some sides means (:func:`padding_note`);
* estimates the bytes it will write (the output arrays and the ``studies/`` cache, which
  holds the same patches) and the bytes one study's arrays take in memory, and refuses what
  the output folder's file system or the memory available cannot hold, naming both figures
  (:func:`check_room`).

The readings of the machine (:func:`free_disk`, :func:`available_memory`) are functions the
tests replace.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from pathlib import Path

#: Bytes a converter may not take of what is free: the rest of the machine keeps a margin.
MARGIN = 0.9


def gigabytes(n: float) -> str:
    """``"1.2 GB"``, ``"924 MB"``, ``"35 kB"`` (decimal units, as ``df -H`` prints them)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if n < 10 * size else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


def free_disk(path: Path) -> int:
    """Bytes free on the file system of ``path`` (its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def available_memory() -> int | None:
    """Bytes of memory a new allocation can take.

    ``MemAvailable``, capped by a cgroup limit; None where neither can be read.
    """
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        found = None
    room = _cgroup_room()
    if room is not None:
        found = room if found is None else min(found, room)
    return found


def _shape(shape: Sequence[int]) -> str:
    return " x ".join(str(s) for s in shape)


def patch_problem(patch: int, sides: Sequence[Sequence[int]], where: str) -> str | None:
    """Why ``--patch`` cannot be cut from the volumes, or None.

    Args:
        patch: the patch side.
        sides: each volume's sides along the patch's axes (2-D: the slice's two, 3-D: three).
        where: the volume of the largest side, for the message.

    Returns:
        The message's tail when ``patch`` exceeds every side of every volume (the patch holds
        a whole volume and pads it on every side), else None.
    """
    if not sides:
        return None
    largest = max(max(s) for s in sides)
    if patch <= largest:
        return None
    biggest = max(sides, key=max)
    share = math.floor(1000 * (1 - _volume(biggest) / patch ** len(biggest))) / 10
    return (
        f"--patch {patch}: larger than every side of the volumes (the largest, {where}, is "
        f"{_shape(biggest)}): each patch would be at least {share}% zero padding; "
        f"expected --patch {largest - largest % 2} or less"
    )


def _volume(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def padding_note(patch: int, sides: Sequence[Sequence[int]], names: str) -> str | None:
    """One line when ``patch`` exceeds some sides of the smallest volume: what it pads.

    Args:
        patch: the patch side.
        sides: each volume's sides along the patch's axes.
        names: the axes' names, one letter each (``"XY"``, ``"XYZ"``, ``"zyx"``).
    """
    if not sides:
        return None
    smallest = [min(s[k] for s in sides) for k in range(len(sides[0]))]
    padded = [f"{n} ({s} voxels)" for n, s in zip(names, smallest, strict=True) if patch > s]
    if not padded:
        return None
    return (
        f"note: --patch {patch} is longer than the volumes along {', '.join(padded)}: "
        "patches are zero-padded there"
    )


def _check_patch(
    patch: int, given: bool, sides: Sequence[Sequence[int]], where: str, names: str, say: object
) -> None:
    """Refuse a given ``--patch`` larger than every volume; note the padding of any other."""
    problem = patch_problem(patch, sides, where)
    if problem is not None and given:
        raise SystemExit(f"error: {problem}")
    note = padding_note(patch, sides, names)
    if problem is not None:  # the default patch on small volumes: said, not refused
        note = f"note: the default {problem.split(': ', 1)[1].split('; expected')[0]}"
    if note is not None:
        say(note)  # type: ignore[operator]


def check_room(
    what: str,
    disk: int,
    disk_parts: str,
    memory: int,
    memory_unit: str,
    out: Path,
) -> None:
    """Refuse a conversion the disk or the memory cannot hold, in one line naming both figures.

    Args:
        what: the options that set the sizes, e.g. ``"--dims 3 --patch 998"``.
        disk: bytes it will write.
        disk_parts: what those bytes are, e.g. ``"images.npy, masks.npy and the studies/
            cache of 3 patients"``.
        memory: bytes one study's arrays take at once.
        memory_unit: the study, e.g. ``"patient"``.
        out: the output folder (its file system).

    Raises:
        SystemExit: ``error: --dims 3 --patch 998: the output needs about 95 GB (...), but
            OUT's file system has 20 GB free``; or the memory's line.
    """
    free = free_disk(out) if disk else 0
    if disk and disk > free * MARGIN:
        raise SystemExit(
            f"error: {what}: the output needs about {gigabytes(disk)} ({disk_parts}), but the "
            f"file system of {out} has {gigabytes(free)} free"
        )
    room = available_memory()
    if memory and room is not None and memory > room * MARGIN:
        raise SystemExit(
            f"error: {what}: each {memory_unit}'s arrays need about {gigabytes(memory)} of "
            f"memory, but {gigabytes(room)} is available"
        )


def nifti_shape(path: Path) -> tuple[int, ...] | None:
    """A NIfTI volume's first three sides in the closest canonical (RAS) order.

    From its header (no voxel is read); None for a file that cannot be read (the patient is
    skipped later, with why).
    """
    import nibabel as nib

    try:
        image = nib.load(str(path))
        shape = image.shape[:3]
        axes = nib.orientations.io_orientation(image.affine)[:, 0]
    except Exception:  # nibabel raises many types for corrupt files
        return None
    if len(shape) != 3 or any(a != a for a in axes):  # (NaN: a degenerate affine)
        return None
    canonical = [0, 0, 0]
    for j, axis in enumerate(axes):
        canonical[int(axis)] = int(shape[j])
    return tuple(canonical)


def check_brats(
    segs: Sequence[Path],
    dims: int,
    patch: int,
    given: bool,
    labels: str,
    out: Path,
    say: object,
) -> None:
    """The BraTS converter's checks before it makes ``out`` (module docstring).

    Args:
        segs: each patient's segmentation file (the grid its images share).
        dims: 2 (slice patches) or 3 (one crop a patient).
        patch: the patch side.
        given: whether ``--patch`` was given (the default's padding is only noted).
        labels: ``whole`` (one mask channel) or ``regions`` (three).
        out: the output folder.
        say: prints a note line (a rich console's ``print``).

    Raises:
        SystemExit: a patch larger than every volume, or an output the disk or the memory
            cannot hold (the 2-D output's size is known once the slices are chosen:
            :func:`check_room` again before it is written).
    """
    shapes = [(s, p) for p in segs if (s := nifti_shape(p)) is not None]
    sides = [s[:dims] for s, _ in shapes]
    largest = max(shapes, key=lambda sp: max(sp[0][:dims]), default=None)
    _check_patch(patch, given, sides, str(largest[1]) if largest else "", "XYZ"[:dims], say)
    if not shapes:
        return
    voxels = max(_volume(s) for s, _ in shapes)
    slices = max(s[2] for s, _ in shapes)
    mask = 1 if labels == "whole" else 3
    what = f"--dims {dims} --patch {patch}"
    if dims == 3:  # one crop a patient: its output, its cache entry; the crop and its window
        disk = len(segs) * (16 + mask + 19) * patch**3
        parts = f"images.npy, masks.npy and the studies/ cache of {len(segs)} patients"
        memory = 36 * voxels + 2 * 19 * patch**3
    else:  # at most every slice of a patient: its patches and masks
        disk, parts = 0, ""
        memory = 36 * voxels + 19 * patch**2 * slices
    check_room(what, disk, parts, memory, "patient", out)


def mhd_shape(path: Path) -> tuple[int, ...] | None:
    """A MetaImage volume's sides as its array holds them (z, y, x), from its header.

    None for a header that cannot be read (the study is skipped later, with why).
    """
    from data_prep.mhd import read_mhd_header

    try:
        header, _ = read_mhd_header(path)
        sides = tuple(int(v) for v in header["DimSize"].split())
    except Exception:  # a StudyError, OSError, a DimSize not of numbers: skipped later
        return None
    return sides[::-1] if len(sides) == 3 else None


def check_luna(
    volumes: dict[str, Path],
    rows: dict[str, int],
    dims: int,
    patch: int,
    given: bool,
    out: Path,
    say: object,
) -> None:
    """The LUNA16 converter's checks before it cuts a patch (module docstring).

    Args:
        volumes: each study's header, by series UID.
        rows: each study's candidate rows to cut.
        dims: 2 (axial patches: a slice's y, x) or 3 (cubes: z, y, x).
        patch: the patch side.
        given: whether ``--patch`` was given (the default's padding is only noted).
        out: the output folder.
        say: prints a note line.

    Raises:
        SystemExit: a patch larger than every volume, or patches the disk or the memory
            cannot hold.
    """
    shapes = [(s, volumes[uid]) for uid in rows if (s := mhd_shape(volumes[uid])) is not None]
    sides = [s[3 - dims :] for s, _ in shapes]
    largest = max(shapes, key=lambda sp: max(sp[0][3 - dims :]), default=None)
    _check_patch(patch, given, sides, str(largest[1]) if largest else "", "zyx"[3 - dims :], say)
    if not shapes:
        return
    each = 4 * patch**dims  # float32
    n = sum(rows.values())
    disk = 2 * n * each + 8 * n  # the patches in the cache and in images.npy; labels.npy
    memory = 8 * max(_volume(s) for s, _ in shapes) + 2 * each * max(rows.values())
    what = f"--dims {dims} --patch {patch}"
    parts = f"images.npy and the studies/ cache of {n} candidates"
    check_room(what, disk, parts, memory, "volume", out)
