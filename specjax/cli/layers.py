"""The --layers flag: how the LLM's layer weights are laid out (``specjax.load_model(split_layers=...)``)."""

from __future__ import annotations

LAYOUTS = {"auto": None, "split": True, "stacked": False}


def add_layers_flag(parser) -> None:
    parser.add_argument("--layers", default="auto", choices=list(LAYOUTS),
                        help="layer weight layout: split (one buffer per layer, read in place: on a CPU a decode "
                             "step of SmolLM2 25.9 ms instead of 42, compiling 1.6x as long), stacked (what a mesh "
                             "and a GPU use), auto = split on one CPU device, else stacked")


def split_layers_arg(args) -> bool | None:
    """``load_model``'s split_layers for the parsed --layers (None: the loader decides)."""
    return LAYOUTS[args.layers]
