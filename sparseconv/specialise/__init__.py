"""Stage 3, specialise: the template PTX + a layer's real weights -> the layer's PTX.

    analysis.py  template PTX -> TemplateLayout (loop body, liveness, piece interface)
    weights.py   arrange_weights: a layer's weights in placeholder body order
    pieces.py    plan_pieces and the loop state split k-blocks hand on
    emit.py      specialise(): where a layer's weights enter the PTX

Imports run one way: analysis <- pieces <- emit, weights <- emit.
"""
from .analysis import SpecialiseError, TemplateLayout, analyse_template
from .emit import SpecialiseStats, specialise
from .pieces import MAX_PIECE_LINES, STATE_SYMBOL, plan_pieces
from .weights import arrange_weights

__all__ = ["specialise", "analyse_template", "arrange_weights", "SpecialiseError", "SpecialiseStats",
           "TemplateLayout", "MAX_PIECE_LINES", "STATE_SYMBOL", "plan_pieces"]
