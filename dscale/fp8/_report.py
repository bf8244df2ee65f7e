"""The recipe fields' heatmaps of ``python -m dscale.report``: rowwise, MXFP8 and NVFP4.

Float8Numerics logs each recipe's own fields beside the shared shares (dscale/fp8/_granular.py,
dscale/fp8/_nvfp4_stats.py); a run draws the views of the fields it logged, each a layer x step
heatmap of the worst rank's value. The tensorwise views (flushed, subnormal, saturated, amax
headroom) stay in dscale/report.py.
"""

from __future__ import annotations

#: View -> the y label of its heatmap (the view is the field's name in the log).
LABELS = {
    "rows_saturated": "rows with a\nsaturated element",
    "rows_flushed": "rows with a\nflushed element",
    "blocks_clamped": "blocks with a\nclamped scale",
    "blocks_nonfinite": "blocks\nnon-finite",
    "scale_spread": "scale spread\n(binades)",
    "tensor_scale": "NVFP4 tensor\nscale",
}
#: The views, in drawing order.
VIEWS = tuple(LABELS)
