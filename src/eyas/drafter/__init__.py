"""The EAGLE-3 draft model (model.py), its vocabulary mapping (vocab.py) and the training-time-test loss (ttt/)."""
