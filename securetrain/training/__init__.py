"""securetrain.training"""
