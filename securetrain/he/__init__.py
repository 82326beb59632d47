"""securetrain.he"""
