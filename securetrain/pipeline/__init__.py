"""securetrain.pipeline"""
