"""securetrain.crypto"""
