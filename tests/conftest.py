import sys
from pathlib import Path

# tests/harness.py is shared by every test folder (the folders are not packages).
sys.path.insert(0, str(Path(__file__).parent))
