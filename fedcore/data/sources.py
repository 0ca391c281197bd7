"""Readers for the file datasets users already have: image folder trees and CSV/Parquet tables.

Each returns plain numpy arrays and raises `DatasetError` with one line naming the file,
folder or column and what to do. Pillow and pyarrow are imported lazily so that
`import fedcore.data` stays numpy-only (the scheduler imports it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import DatasetError

IMAGE_MODES_GRAY = ("1", "L", "LA", "I", "I;16", "F", "P")
DEFAULT_LABEL_COLUMN = "label"
OPTIONS = {
    "npz": ("classes",),
    "csv": ("label", "classes"),
    "parquet": ("label", "classes"),
    "imagefolder": ("size",),
}


def split_options(name: str, kind: str, text: str) -> tuple[str, dict[str, str]]:
    """``PATH#key=value&key=value`` -> (PATH, options); unknown keys are an error."""
    path, sep, rest = text.partition("#")
    options: dict[str, str] = {}
    allowed = OPTIONS[kind]
    for item in rest.split("&") if sep else ():
        key, eq, value = item.partition("=")
        if not eq or key not in allowed or not value:
            raise DatasetError(
                f"dataset {name!r}: option {item!r} is not understood; {kind}: datasets take "
                + (", ".join(f"#{k}=..." for k in allowed) or "no options")
                + " (several joined by '&')"
            )
        options[key] = value
    return path, options


def int_option(name: str, options: Mapping[str, str], key: str) -> int | None:
    if key not in options:
        return None
    try:
        value = int(options[key])
    except ValueError:
        value = 0
    if value < 1:
        raise DatasetError(f"dataset {name!r}: option #{key}={options[key]} must be a positive integer")
    return value


# ---- tables ----------------------------------------------------------------------------


def class_names(name: str, options: Mapping[str, str]) -> list[str] | None:
    """``#classes=NAME,NAME,...``: a label column of names, each name's class id its place
    in the list; None for no option or a count (``#classes=C``, `int_option`)."""
    text = options.get("classes")
    if text is None or text.strip().isdigit():
        return None
    names = [n.strip() for n in text.split(",")]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if len(names) < 2 or "" in names or dupes:
        raise DatasetError(f"dataset {name!r}: option #classes={text} must be a class count or "
                           "two or more distinct names joined by ','"
                           + (f" ({', '.join(map(repr, dupes))} twice)" if dupes else ""))
    return names


def read_table(path: str, kind: str, label_column: str, names: list[str] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Features (n, f) float32 and labels (n,) int64 of a CSV or Parquet file.

    Every column but ``label_column`` is a feature and must be numeric without missing values.
    A label column of names (strings) needs ``names``, the classes in the order of their
    ids (``#classes=NAME,...``): sorted as found, a site whose file lacks a class would
    number the others differently from the rest.
    """
    try:
        import pyarrow as pa
        if kind == "csv":
            import pyarrow.csv as pacsv

            table = pacsv.read_csv(path)
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
    except ImportError as exc:
        raise DatasetError(f"dataset file {path}: reading {kind} needs pyarrow ({exc}); "
                           "pip install pyarrow") from None
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(f"dataset file {path}: not a readable {kind} file ({first})") from None
    columns = list(table.column_names)
    if label_column not in columns:
        raise DatasetError(
            f"dataset file {path}: no label column {label_column!r}; columns are "
            f"{', '.join(map(repr, columns[:20]))}{' ...' if len(columns) > 20 else ''}; "
            f"name it with {kind}:PATH#label=COLUMN"
        )
    features = [c for c in columns if c != label_column]
    if not features:
        raise DatasetError(f"dataset file {path}: only the label column {label_column!r}; "
                           "need at least one feature column")
    if table.num_rows == 0:
        raise DatasetError(f"dataset file {path}: no rows")
    label_names = _names_type(pa, table.column(label_column).type)
    for col in columns:
        arr = table.column(col)
        if arr.null_count:
            raise DatasetError(f"dataset file {path}: column {col!r} has {arr.null_count} missing "
                               "value(s); fill or drop them before training")
        typ = arr.type
        if col == label_column:
            if label_names:
                continue  # names: mapped to ids below
            if names is not None:
                raise DatasetError(f"dataset file {path}: #classes names classes, but label "
                                   f"column {col!r} holds {typ} values, not names; give the "
                                   "class count (#classes=C) or none")
            if not pa.types.is_integer(typ):
                raise DatasetError(f"dataset file {path}: label column {col!r} has type {typ}; "
                                   "labels must be integer class ids 0..C-1 or names (strings)")
        elif not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)):
            raise DatasetError(f"dataset file {path}: feature column {col!r} has type {typ}; "
                               "features must be numbers (encode or drop this column)")
    x = np.column_stack([table.column(c).to_numpy(zero_copy_only=False).astype(np.float32)
                         for c in features])
    column = table.column(label_column)
    if label_names:
        y = label_ids(path, label_column, kind,
                      np.asarray(column.cast(pa.string()).to_pylist(), dtype=object), names)
    else:
        y = column.to_numpy(zero_copy_only=False).astype(np.int64)
    return np.ascontiguousarray(x), y


def _names_type(pa: Any, typ: Any) -> bool:
    """A label column of names: strings, or a dictionary of them (a pandas category)."""
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return bool(pa.types.is_string(typ) or pa.types.is_large_string(typ))


#: names a label column's error spells out, ready to paste into #classes=
PASTE_NAMES = 100


def label_ids(path: str, column: str, kind: str, values: np.ndarray,
              names: list[str] | None) -> np.ndarray:
    """Class ids of a label column of names: each name's place in `names`."""
    found, counts = np.unique(values.astype(str), return_counts=True)
    if names is None:
        listed = (",".join(found.tolist()) if len(found) <= PASTE_NAMES
                  else f"NAME,... (its {len(found)} names, in the order of their ids)")
        raise DatasetError(
            f"dataset file {path}: label column {column!r} holds names "
            f"({', '.join(map(repr, found[:10].tolist()))}{' ...' if len(found) > 10 else ''}); "
            f"list the classes in the order of their ids, the same list at every site: "
            f"{kind}:PATH#label={column}&classes={listed}")
    ids = {n: i for i, n in enumerate(names)}
    unknown = [(str(n), int(k)) for n, k in zip(found, counts, strict=True) if n not in ids]
    if unknown:
        raise DatasetError(
            f"dataset file {path}: label column {column!r} has name(s) "
            f"{', '.join(f'{n!r} ({k} sample(s))' for n, k in unknown[:5])} not in "
            f"#classes={','.join(names)}; add them to the list or fix the rows")
    return np.fromiter((ids[str(v)] for v in values), dtype=np.int64, count=len(values))


# ---- image folders ---------------------------------------------------------------------


def image_tree(root: str) -> tuple[str, str | None]:
    """(train dir, test dir or None): ``root/train`` + ``root/test`` if both exist, else root."""
    train, test = os.path.join(root, "train"), os.path.join(root, "test")
    if os.path.isdir(train) and os.path.isdir(test):
        return train, test
    return root, None


def class_folders(root: str) -> list[str]:
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as exc:
        raise DatasetError(f"dataset folder {root}: cannot read it: {exc.strerror}") from None
    if not names:
        raise DatasetError(f"dataset folder {root}: no class subfolders; put each class's images "
                           "in its own subfolder (root/CLASS/*.png)")
    return names


def read_images(root: str, classes: list[str], size: tuple[int, int] | None,
                mode: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """Images under ``root/CLASS/`` as (n, channels, H, W) float32 in [0, 1], labels, mode.

    Labels are the index of the folder in ``classes``. Every image must have the same size
    unless ``size`` (W, H) resizes them; the colour mode follows the first image (gray or RGB)
    unless ``mode`` is given.
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise DatasetError(f"dataset folder {root}: reading images needs Pillow ({exc})") from None
    present = set(class_folders(root))
    unknown = sorted(present - set(classes))
    if unknown:
        raise DatasetError(f"dataset folder {root}: class folder(s) {', '.join(unknown)} are not "
                           "in the training tree; test classes must be training classes")
    pixels: list[np.ndarray] = []
    labels: list[int] = []
    shape: tuple[int, int] | None = None
    first_file = ""
    for label, cls in enumerate(classes):
        folder = os.path.join(root, cls)
        if not os.path.isdir(folder):
            continue
        files = sorted(e.path for e in os.scandir(folder) if e.is_file() and not e.name.startswith("."))
        for file in files:
            try:
                with Image.open(file) as opened:
                    if mode is None:
                        mode = "L" if opened.mode in IMAGE_MODES_GRAY else "RGB"
                    img = opened.convert(mode)
                    if size is not None and img.size != size:
                        img = img.resize(size, Image.Resampling.BILINEAR)
                    data = np.asarray(img, dtype=np.float32)
            except (OSError, ValueError, Image.DecompressionBombError) as exc:
                raise DatasetError(f"dataset image {file}: cannot decode it ({exc}); remove it or "
                                   "convert it to PNG/JPEG") from None
            if shape is None:
                shape, first_file = data.shape[:2], file
            elif data.shape[:2] != shape:
                raise DatasetError(
                    f"dataset image {file}: size {data.shape[1]}x{data.shape[0]} differs from "
                    f"{first_file} ({shape[1]}x{shape[0]}); resize them or add #size=WxH to the name")
            pixels.append(data)
            labels.append(label)
    if not pixels:
        raise DatasetError(f"dataset folder {root}: no image files in its class subfolders")
    x = np.stack(pixels) / 255.0
    x = x[:, None, :, :] if x.ndim == 3 else np.transpose(x, (0, 3, 1, 2))
    assert mode is not None
    return np.ascontiguousarray(x, dtype=np.float32), np.asarray(labels, dtype=np.int64), mode


def parse_size(name: str, text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise DatasetError(f"dataset {name!r}: option #size={text} must be WIDTHxHEIGHT, e.g. 32x32")
    return int(w), int(h)
