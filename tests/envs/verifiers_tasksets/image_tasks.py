"""A verifiers v1 taskset whose tasks show an image (as verifiers' vision envs, color_codeword, do): a 1x1 PNG as a
data URL beside the question, nothing downloaded."""

import verifiers.v1 as vf

PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
         "RU5ErkJggg==")


class ColorTask(vf.Task):
    @vf.reward
    async def named(self, trace) -> float:
        return float("red" in (trace.last_reply or "").lower())


class ImageTaskset(vf.Taskset[ColorTask]):
    def load(self):
        for i in range(2):
            content = [{"type": "text", "text": f"Picture {i}: what color is it?"},
                       {"type": "image_url", "image_url": {"url": PIXEL}}]
            yield ColorTask(vf.TaskData(prompt=[{"role": "user", "content": content}]), self.config.task)


__all__ = ["ColorTask", "ImageTaskset"]
