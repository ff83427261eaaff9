"""The typed config: schemas, composition, the checks a type cannot express, and config mistakes in one line."""
