"""What each token of a forward without attnkit's own batch is, as the reader of the call finds it
(attnkit/attention/call.py): its token class, and for a patch of an image its (row, column) on the patch grid.

A text model's forward (`TEXT`): the first token of each sample is CLS, every other token OTHER
(`layout.first_token_classes`), and no token has a place on a grid.

A vision transformer's forward (`ImageTokens`, docs/features.md "Image heads"): the tokens before the patches
([CLS], DeiT's distillation token, DINOv2's registers; `ImageLayout.prefix`, from the model's config at
`attnkit.instrument`), then the image's patches in row-major order, rows × columns of them: the image's height and
width (recorded from the forward's `pixel_values`, so interpolated position embeddings at another size are
followed) over the patch size. Token classes (attnkit/features.py, IMAGE_*): [CLS] is CLS, the distillation token
and the registers are SEP (the model's extra tokens, which carry no part of the image), every patch is OTHER; a
patch's grid position is its (row, column), a token that is no patch has (−1, −1).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import AttnkitError
from ..features import IMAGE_CLS, IMAGE_DISTILLATION, IMAGE_PATCH, IMAGE_REGISTER
from .layout import first_token_classes


class TextTokens:
    """The tokens of a text model's forward: the first is CLS, the others OTHER; no grid."""

    def token_class(self, B: int, L: int, device) -> torch.Tensor:
        return first_token_classes(B, L, device)

    def grid(self, B: int, L: int, device) -> None:
        return None


TEXT = TextTokens()


@dataclass(frozen=True)
class ImageLayout:
    """The tokens of a vision transformer, from its config: the token classes of the tokens before the patches, in
    order; the patch size and the config's image size (height, width, in pixels); the image's channels."""

    model_type: str
    prefix: tuple
    patch: tuple
    image: tuple
    channels: int

    def probe_pixels(self, device, dtype) -> torch.Tensor:
        """A tiny random image batch of the config's size and channels (1 × C × H × W): the probe forward's input."""
        gen = torch.Generator().manual_seed(0)
        return torch.rand(1, self.channels, *self.image, generator=gen).to(device=device, dtype=dtype)


def _pair(x) -> tuple:
    return (int(x[0]), int(x[1])) if isinstance(x, (list, tuple)) else (int(x), int(x))


def _registers(cfg) -> tuple:
    return (IMAGE_CLS,) + (IMAGE_REGISTER,) * int(getattr(cfg, "num_register_tokens", 0) or 0)


# The vision transformers attnkit knows the tokens of: model type → the classes of the tokens before the patches
PREFIXES = {
    "vit": lambda cfg: (IMAGE_CLS,),
    "deit": lambda cfg: (IMAGE_CLS, IMAGE_DISTILLATION),  # [CLS], then the distillation token
    "beit": lambda cfg: (IMAGE_CLS,),
    "clip_vision_model": lambda cfg: (IMAGE_CLS,),
    "siglip_vision_model": lambda cfg: (),  # patches only (SigLIP pools with an attention head of its own)
    "dinov2": lambda cfg: (IMAGE_CLS,),
    "dinov2_with_registers": _registers,  # [CLS], the registers, then the patches
}


def image_layout(cfg) -> ImageLayout | None:
    """The ImageLayout of a vision transformer's config; None for a model that takes no images. A model that takes
    images but whose tokens attnkit does not know, or whose attention adds what the op does not take, is refused
    by name."""
    mtype = getattr(cfg, "model_type", "")
    if getattr(cfg, "vision_config", None) is not None:
        raise AttnkitError(f"model type {mtype!r} has a vision tower and a text tower; attnkit measures one model "
                           "over one sequence: instrument the vision tower alone (e.g. CLIPVisionModel, "
                           "SiglipVisionModel)")
    if mtype not in PREFIXES:
        if getattr(cfg, "image_size", None) is not None and getattr(cfg, "patch_size", None) is not None:
            raise AttnkitError(f"model type {mtype!r} takes images, but attnkit does not know its tokens (supported "
                               f"vision transformers: {', '.join(sorted(PREFIXES))})")
        return None
    if mtype == "beit" and (getattr(cfg, "use_relative_position_bias", False)
                            or getattr(cfg, "use_shared_relative_position_bias", False)):
        raise AttnkitError("this BEiT adds a learned relative position bias to its attention scores (an L×L bias "
                           "that transformers passes as the attention mask), which attnkit's op does not take; a "
                           "BEiT with absolute position embeddings only is supported")
    return ImageLayout(mtype, PREFIXES[mtype](cfg), _pair(cfg.patch_size), _pair(cfg.image_size),
                       int(getattr(cfg, "num_channels", 3)))


@dataclass(frozen=True)
class ImageTokens:
    """The tokens of one forward of a vision transformer: its layout and the image's size (height, width)."""

    layout: ImageLayout
    size: tuple

    @property
    def shape(self) -> tuple:
        """(rows, columns) of the patch grid."""
        return self.size[0] // self.layout.patch[0], self.size[1] // self.layout.patch[1]

    @property
    def length(self) -> int:
        """The tokens of one image: those before the patches, then the patches."""
        rows, cols = self.shape
        return len(self.layout.prefix) + rows * cols

    def token_class(self, B: int, L: int, device) -> torch.Tensor:
        return image_tokens(self, L, str(device))[0].expand(B, L)

    def grid(self, B: int, L: int, device) -> torch.Tensor:
        return image_tokens(self, L, str(device))[1].expand(B, L, 2)


@functools.lru_cache(maxsize=8)
def image_tokens(tokens: ImageTokens, L: int, device: str) -> tuple:
    """(token classes int32 1×L, grid positions int32 1×L×2) of a forward's image tokens (module docstring),
    computed once per image size: every layer of every forward at that size reads the same ones."""
    prefix, (rows, cols) = tokens.layout.prefix, tokens.shape
    if tokens.length != L:
        raise AttnkitError(f"a {tokens.layout.model_type} forward of a {tokens.size[0]}×{tokens.size[1]} image should "
                           f"have {len(prefix)} tokens before its {rows}×{cols} patches ({tokens.length} "
                           f"in all), but its attention got {L}")
    classes = torch.full((1, L), IMAGE_PATCH, dtype=torch.int32)
    classes[0, :len(prefix)] = torch.tensor(prefix, dtype=torch.int32)
    grid = torch.full((1, L, 2), -1, dtype=torch.int32)
    patches = torch.arange(rows * cols, dtype=torch.int32)
    grid[0, len(prefix):, 0] = patches // cols
    grid[0, len(prefix):, 1] = patches % cols
    return classes.to(device), grid.to(device)


PREFIX_REGION = -1  # the region of the tokens before the patches ([CLS], distillation token, registers)


def region_ids(tokens: ImageTokens, regions, batch: int = 1) -> torch.Tensor:
    """Region ids (int32 batch × L) of a vision transformer's tokens, as sentence ids for region interventions
    (docs/interventions.md, "Regions of an image"): every patch the id of its region, the tokens before the patches
    PREFIX_REGION, a region of their own. `regions`: "quadrants" (0 top left, 1 top right, 2 bottom left, 3 bottom
    right: row · 2 // rows and column · 2 // columns), or a map of non-negative integer region ids, H × W or
    batch × H × W (a label map of the image, in pixels, or one id per patch), which each patch reads at its centre
    (nearest neighbour: row (r + ½) · H / rows, column (c + ½) · W / columns)."""
    rows, cols = tokens.shape
    if isinstance(regions, str):
        if regions != "quadrants":
            raise AttnkitError(f"unknown image regions {regions!r}: give 'quadrants' or a map of region ids")
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        grid = (r * 2 // rows * 2 + c * 2 // cols)[None].expand(batch, rows, cols)
    else:
        m = torch.as_tensor(regions)
        if m.dtype.is_floating_point or m.dtype == torch.bool or m.dtype.is_complex:
            raise AttnkitError(f"a region map holds integer region ids, got {m.dtype}")
        if m.dim() == 2:
            m = m[None].expand(batch, *m.shape)
        if m.dim() != 3 or m.shape[0] != batch or min(m.shape[1:]) < 1:
            raise AttnkitError(f"a region map is H × W or batch × H × W with batch {batch}, got shape {tuple(m.shape)}")
        if bool((m < 0).any()):
            raise AttnkitError("region ids are non-negative integers (−1 is the region of [CLS] and the registers)")
        H, W = m.shape[1:]
        at_r = ((torch.arange(rows) * 2 + 1) * H // (2 * rows)).long()
        at_c = ((torch.arange(cols) * 2 + 1) * W // (2 * cols)).long()
        grid = m[:, at_r][:, :, at_c]
    prefix = len(tokens.layout.prefix)
    out = torch.full((batch, prefix + rows * cols), PREFIX_REGION, dtype=torch.int32)
    out[:, prefix:] = grid.reshape(batch, rows * cols).to(torch.int32)
    return out


def read_tokens(rt, forward) -> TextTokens | ImageTokens:
    """The tokens of `forward` (attnkit/attention/context.py) on Runtime `rt` (None: not instrumented): an image's
    when the model is a vision transformer (the Runtime's ImageLayout; the image's size from the forward's
    pixel_values, else the config's), else a text's."""
    layout = None if rt is None else rt.image
    if layout is None:
        return TEXT
    size = None if forward.inputs is None else forward.inputs.image_size
    return ImageTokens(layout, tuple(size) if size is not None else layout.image)
