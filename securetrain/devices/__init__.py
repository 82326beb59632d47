"""securetrain.devices"""
