"""Drop-in APIs of other libraries, mapped onto harvest's core."""
