"""Trainers of the learned rewards, apart from the reward functions that use them: the
Bradley-Terry reward model (reward_model.py, `slime train-rm`) and the process reward model
(prm.py, `slime train-prm`); common.py holds their data reading, loop and command line."""
