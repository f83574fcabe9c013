"""A run's figures: what they show, how matplotlib draws them, and where.

``plots.py`` chooses what a run's figures show (the data, the clients shown) and asks for them
by name; ``pca.py`` holds the client models' PCA the models' figure shows; ``canvas.py``
draws them with matplotlib; ``drawer.py`` draws them in this process's one drawing thread or
in a helper process on an idle core. The arrows run plots → drawer → canvas → pca and
plots → pca, with no circle (``tests/test_imports.py``). Nothing here is imported by this
``__init__``: the helper process imports ``canvas`` alone, without torch.
"""
