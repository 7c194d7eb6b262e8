# The 10x prompt mix's reference_prompts.py arguments, shared by the scripts that write it
# (train_reference_drafters.sh, lever_ab.sh), so that both train on the same mix.
REFERENCE_MIX=(--instructions 1600 --wide-instructions 24000 --code 8000 --maths 6000 --followup-fraction 0.25
               --easy-vqa 3000)
