"""Logical device meshes for N devices: (N,) and every (a, b) with a·b = N."""

from __future__ import annotations

import itertools
import re

from autoplan.errors import AutoplanError


def candidate_meshes(devices: int) -> list[tuple[int, ...]]:
    """(N,) first, then the 2-D meshes (a, b), a, b ≥ 2, in increasing a."""
    if devices < 1:
        raise AutoplanError(f"--devices must be at least 1, got {devices}")
    meshes: list[tuple[int, ...]] = [(devices,)]
    meshes += [(a, devices // a) for a in range(2, devices) if devices % a == 0 and devices // a >= 2]
    return meshes


def parse_mesh(text: str, devices: int | None = None) -> tuple[int, ...]:
    """``"8"`` → (8,), ``"2x4"`` → (2, 4); the product must equal ``devices`` when given."""
    if not re.fullmatch(r"\s*\d+(\s*[xX,]\s*\d+)?\s*", text):
        raise AutoplanError(f"cannot read mesh {text!r}: write it like 8 or 2x4")
    shape = tuple(int(x) for x in re.split(r"[xX,]", text))
    if any(x < 1 for x in shape):
        raise AutoplanError(f"mesh {text!r} has an empty axis: every axis needs at least one device")
    product = 1
    for x in shape:
        product *= x
    if devices is not None and product != devices:
        raise AutoplanError(f"mesh {text} holds {product} devices but --devices is {devices}: make them agree")
    return shape


def mesh_label(shape: tuple[int, ...] | list[int]) -> str:
    return "x".join(str(x) for x in shape)


def meshes_label(meshes: list[tuple[int, ...]] | list[list[int]]) -> str:
    """The logical mesh of each stage, runs of equal ones counted: ``4, 2x2 ×14, 4``."""
    runs = [(label, len(list(group))) for label, group in itertools.groupby(mesh_label(m) for m in meshes)]
    return ", ".join(label if count == 1 else f"{label} ×{count}" for label, count in runs)


def stage_meshes_text(meshes: list[tuple[int, ...]] | list[list[int]]) -> str:
    """``mesh 2x2`` when every stage has that logical mesh, else ``stage meshes 4, 2x2 ×2``."""
    if len({tuple(m) for m in meshes}) == 1:
        return f"mesh {mesh_label(meshes[0])}"
    return f"stage meshes {meshes_label(meshes)}"
