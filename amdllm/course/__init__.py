"""The course: its embedded default model and data (`default_model`), the generated text and task
(`corpus`), the headless notebook runner (`notebooks`), figures (`plots`) and widgets (`widgets`).
With `amdllm.cli`, the only layer that knows the default model. The names lessons use most are here:

    from amdllm import course
    model_dir = course.default_model_dir()
    train_path, heldout_path = course.task_paths()"""
from amdllm.course.default_model import (COMMITTED, EVAL_SEQ_LEN, MODEL, TRAIN, VOCAB_MULTIPLE,  # noqa: F401
                                         CourseError, amdllm_home, build_default_model, cached_model_dir,
                                         committed_is_current, committed_model_dir, data_dir,
                                         default_model_dir, heldout_perplexity, heldout_text_path,
                                         model_config, quoted_word_accuracy, task_paths, tokenizer_dir,
                                         write_data)
