"""De-identify a folder of DICOM files with a shipped policy (PS3.15 Annex E Basic Profile).

    python examples/scripts/deidentify_folder.py IN_DIR OUT_DIR
The 32-byte key keys every pseudonym, UID and date shift: keep it secret, reuse it for longitudinal data.
"""

import os
import sys

from securetrain.masking.dicom import deidentify_tree, load_policy

key = bytes.fromhex(os.environ["DEID_KEY_HEX"]) if "DEID_KEY_HEX" in os.environ else os.urandom(32)
report = deidentify_tree(sys.argv[1], sys.argv[2], load_policy("dicom-basic"), key)
refused = report.rejected + report.quarantined
for index, result in enumerate(report.results):  # indexes, not input names: names can carry PHI
    print(index, result.outcome.value, result.reason or "")
print(f"{report.written} written, {refused} refused ({report.rejected} rejected, {report.quarantined} quarantined)")
# As `securetrain deid`: files the policy rejects (burned-in text) are the policy working; quarantined
# files (unreadable, not DICOM) are a data problem, and a run with them is not a success.
sys.exit(65 if report.quarantined else 0)
