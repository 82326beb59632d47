"""Pixel decoders for compressed DICOM: GDCM decodes what nothing else installed here can.

JPEG Lossless (processes 14, including selection value 1, the usual archive format of CT and MR)
and JPEG-LS are decoded through GDCM (``python-gdcm``, BSD licensed; the other pydicom plugin for
them, pylibjpeg-libjpeg, is GPL). pydicom lists GDCM *first* for every syntax it can decode, so
installing it would also change which plugin decodes JPEG baseline and JPEG 2000, and with it the
decoded pixels (colour conversion, rounding). :func:`gdcm_last_resort` moves GDCM to the end of
each pydicom decoder's plugin list, through pydicom's public ``remove_plugin``/``add_plugin``:
the plugins used before (Pillow, pylibjpeg, pydicom's RLE) stay first where they are available,
and GDCM decodes only syntaxes they cannot (or images they fail on). Idempotent; called when the
DICOM modules that decode pixels are imported.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_GDCM_PLUGIN = ("pydicom.pixels.decoders.gdcm", "_decode_frame")
_configured = False


def gdcm_last_resort() -> None:
    """Make GDCM the last plugin tried by every pydicom decoder that has another one available."""
    global _configured
    if _configured:
        return
    _configured = True
    try:
        from pydicom.pixels import get_decoder
        from pydicom.uid import AllTransferSyntaxes
    except ImportError:  # pragma: no cover - pydicom < 3 is not supported anyway
        return
    for uid in AllTransferSyntaxes:
        try:
            decoder = get_decoder(uid)
        except (NotImplementedError, ValueError):
            continue  # no decoder for this syntax at all
        plugins = decoder.available_plugins
        if "gdcm" in plugins and len(plugins) > 1:  # re-adding appends: tried after the others
            decoder.remove_plugin("gdcm")
            decoder.add_plugin("gdcm", _GDCM_PLUGIN)
            log.debug("pixel decoding of %s: GDCM moved behind %s", uid.name, ", ".join(p for p in plugins if p != "gdcm"))
