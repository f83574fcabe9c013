"""Graphs over the clients and the server-side solvers of their penalties.

pFedNet's similarity network (sketches, k-NN graph, incidence operations), the solvers of its
sum-of-norms penalty (``admm``: the z-step ADMM; ``prox``: column proxes) and FPFC's pairwise
fusion penalties (``fusion``: SCAD / MCP group proxes). See ``docs/pfednet_math.md``.
"""

from fedexp.graph.incidence import apply_Q
from fedexp.graph.incidence import apply_Qt
from fedexp.graph.incidence import as_edge_tensor
from fedexp.graph.incidence import incidence_matrix
from fedexp.graph.knn import Graph
from fedexp.graph.knn import canonical_edges
from fedexp.graph.knn import knn_edges
from fedexp.graph.knn import laplacian
from fedexp.graph.sketches import covariance_sketch
from fedexp.graph.sketches import kernel_sketch
from fedexp.graph.sketches import label_sketch
from fedexp.graph.sketches import make_rff
from fedexp.graph.sketches import median_bandwidth
from fedexp.graph.sketches import model_sketch
from fedexp.graph.sketches import sketch_distances

__all__ = [
    "Graph",
    "apply_Q",
    "apply_Qt",
    "as_edge_tensor",
    "canonical_edges",
    "covariance_sketch",
    "incidence_matrix",
    "kernel_sketch",
    "knn_edges",
    "label_sketch",
    "laplacian",
    "make_rff",
    "median_bandwidth",
    "model_sketch",
    "sketch_distances",
]
