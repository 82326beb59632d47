"""Public attributes outside Table E.1-1 whose *text* values are kept by default.

Table E.1-1 lists what may identify; everything else is, per the standard, kept. We are stricter:
an unlisted public attribute with a free-text VR (LO, SH, ST, LT, UT, UC, UR, AE), or one the data
dictionary does not know, is removed unless it is named here or the policy keeps it with an
override (``overrides: {Keyword: K}``; kept text is still scrubbed of removed values). The list
holds coded or technical descriptors that name *things* (codes, equipment models, acquisition
techniques, units), never people, places or dates. Numeric and coded-string (CS) attributes are
kept without a list: their value domain leaves no room for names.
"""

from __future__ import annotations

from functools import lru_cache

from pydicom.datadict import keyword_for_tag

SAFE_UNLISTED_TEXT_KEYWORDS: frozenset[str] = frozenset(
    {
        # coded entries (PS3.3 8.8): the meaning of a code, never a person
        "CodeValue", "CodingSchemeDesignator", "CodingSchemeVersion", "CodeMeaning", "LongCodeValue",
        "URNCodeValue", "CodingSchemeName", "CodingSchemeResponsibleOrganization",
        "MappingResourceName",
        # equipment type (not identity: serials, station names and AE titles are in the table)
        "Manufacturer", "ManufacturerModelName", "SoftwareVersions", "TransducerData", "ProcessingFunction",
        "AcquisitionDeviceProcessingCode", "DetectorDescription",
        # acquisition and reconstruction technique
        "SequenceName", "PulseSequenceName", "ConvolutionKernel", "FilterType", "ReceiveCoilName",
        "TransmitCoilName", "ImagedNucleus", "ContrastBolusRoute", "Radiopharmaceutical", "RadiopharmaceuticalRoute",
        "AttenuationCorrectionMethod", "ScatterCorrectionMethod", "ReconstructionMethod", "DecayCorrection",
        "PositionReferenceIndicator", "ReconstructionAlgorithm",
        # presentation: how to display pixel values
        "WindowCenterWidthExplanation", "RescaleType", "LUTExplanation", "ContentLabel",
        # file-set/meta bookkeeping written by implementations; the format of an encapsulated document
        "ImplementationVersionName", "MIMETypeOfEncapsulatedDocument",
        # the de-identification record itself (written after the pass)
        "DeidentificationMethod",
    }
)


@lru_cache(maxsize=4096)
def is_safe_unlisted_text(tag: int) -> bool:
    return (keyword_for_tag(tag) or "") in SAFE_UNLISTED_TEXT_KEYWORDS
