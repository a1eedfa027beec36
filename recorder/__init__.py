"""A session recorder: accepts recordings over upstream's recording protocol and stores them as cast files."""
