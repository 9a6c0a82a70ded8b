"""Training for kvfold: the EAGLE-3 draft (training-time test, data, the CLI).

training imports model (and quant); nothing imports training. The draft's network
itself lives in model/eagle3.py so that serving can run it.
"""
