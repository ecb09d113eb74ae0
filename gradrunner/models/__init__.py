"""Small built-in models, one file each, for examples, tests and benchmarks.

| class | file | what it shows |
| --- | --- | --- |
| `MLP` | `mlp.py` | `fc1, relu1, ..., head`: glob taps over layers, in-place ReLU |
| `SmallCNN` | `cnn.py` | convolutions, pooling, locals `features`, `logits` |
| `TinyTransformerBlock` | `transformer.py` | tuple outputs (`attn:output.0`), a module called twice |
| `CosineRegression` | `cosine.py` | `cos(a * x) - b`: scalar parameters `a`, `b`; locals `mul_x`, `sum_x` |
| `TwoLayerSigmoid` | `sigmoid2.py` | `y_2 = sigmoid(W2 @ sigmoid(W1 @ x))`: locals `z_1`, `y_1`, `z_2`, `y_2` |
"""

from gradrunner.models.cnn import SmallCNN
from gradrunner.models.cosine import CosineRegression
from gradrunner.models.mlp import MLP
from gradrunner.models.sigmoid2 import TwoLayerSigmoid
from gradrunner.models.transformer import TinyTransformerBlock

__all__ = ["MLP", "CosineRegression", "SmallCNN", "TinyTransformerBlock", "TwoLayerSigmoid"]
